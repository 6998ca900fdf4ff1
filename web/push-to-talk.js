// Push-to-talk: the talk button (pointer or Enter) held while the caller speaks; on release, a short tail of
// audio, then input_audio_buffer.commit. Space on the page does the same (App.onKey).
import { $ } from "./dom.js";

const PTT_TAIL_MS = 150; // keep sending this long after release so the last syllable reaches the server first

/** The push-to-talk of the App `app` (its settings, call, state, media and transcript). */
export class PushToTalk {
  constructor(app) {
    this.app = app;
    this.held = false;
    this.releasedAt = null; // perf ms of the last release: the caller's end of speech
  }

  bind() {
    const b = $("ptt-btn");
    b.addEventListener("pointerdown", (e) => {
      if (e.button !== 0) return;
      b.setPointerCapture?.(e.pointerId);
      this.down();
    });
    for (const ev of ["pointerup", "pointercancel", "lostpointercapture"]) b.addEventListener(ev, () => this.up());
    b.addEventListener("contextmenu", (e) => e.preventDefault());
    b.addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.repeat) this.down(); });
    b.addEventListener("keyup", (e) => { if (e.key === "Enter") this.up(); });
  }

  down() {
    const { app } = this;
    if (!app.settings.ptt || !app.call || this.held) return;
    this.held = true;
    this.releasedAt = null;
    $("ptt-btn").classList.add("held");
    $("ptt-btn").querySelector(".ctl-label").textContent = "Release to send";
    const answer = app.transcript.current;
    if (answer && !answer.done) app.call.send({ type: "response.cancel" });
    app.media.applyTrackEnabled();
    if (["listening", "speaking", "thinking"].includes(app.state)) app.setState("hearing");
    $("state-hint").textContent = "Talking… release to send.";
  }

  up() {
    const { app } = this;
    if (!this.held) return;
    this.held = false;
    this.releasedAt = performance.now();
    $("ptt-btn").classList.remove("held");
    $("ptt-btn").querySelector(".ctl-label").textContent = "Hold to talk";
    const call = app.call;
    setTimeout(() => {
      if (call && call === app.call) call.send({ type: "input_audio_buffer.commit" });
      app.media.applyTrackEnabled();
      if (app.state === "hearing" && !app.transcript.currentUser) app.setState("listening");
    }, PTT_TAIL_MS);
  }
}
