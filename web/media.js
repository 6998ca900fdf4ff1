// The page's media: the microphone (its constraints, mute and push-to-talk gating, the level meter), the camera
// and screen share with the self view, the agent's audio, the screen wake lock, and what a failed device says.
import { $ } from "./dom.js";
import { AGENT_THRESHOLD } from "./latency.js";
import { Meters } from "./meter.js";
import { listDevices, saveSettings } from "./settings.js";

const MIC_THRESHOLD = 0.01; // caller speech (RMS) for the end-of-speech time

/** The media of the App `app` (its settings, mode, call, push-to-talk, alert and settings dialog). */
export class Media {
  constructor(app) {
    this.app = app;
    this.meters = new Meters();
    this.micStream = null;
    this.micTrack = null;
    this.micMeter = null;
    this.agentMeter = null;
    this.camTrack = null;
    this.screenTrack = null;
    this.camOn = app.video && app.params.get("video") === "1";
    this.camWanted = false; // the camera was on when the last call ended: it comes back with the next one
    this.muted = false;
    this.wakeLock = null;
  }

  // ---- the microphone ---------------------------------------------------------------------------------
  audioConstraints() {
    const p = this.app.settings.processing;
    const c = { echoCancellation: p, noiseSuppression: p, autoGainControl: p, channelCount: 1 };
    if (this.app.settings.micId) c.deviceId = { exact: this.app.settings.micId };
    return c;
  }

  async openMic() {
    const { app } = this;
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: this.audioConstraints() });
    } catch (err) {
      if (app.settings.micId && (err.name === "OverconstrainedError" || err.name === "NotFoundError")) {
        app.settings.micId = ""; // the saved microphone is gone: take the default one
        saveSettings(app.settings);
        stream = await navigator.mediaDevices.getUserMedia({ audio: this.audioConstraints() });
      } else {
        throw err;
      }
    }
    const track = stream.getAudioTracks()[0];
    if (!track) throw Object.assign(new Error("no audio track"), { name: "NotFoundError" });
    track.addEventListener("ended", () => {
      if (app.inCall) app.alert.show({ title: "Microphone disconnected", text: "Pick another microphone in Settings.",
        action: { label: "Settings", fn: () => app.openSettings() } });
    });
    return { stream, track };
  }

  async useMic({ stream, track }) {
    const old = this.micTrack;
    this.micStream = stream;
    this.micTrack = track;
    this.applyTrackEnabled();
    if (this.app.call) await this.app.call.replaceMicTrack(track, stream);
    if (old && old !== track) old.stop();
    this.micMeter?.stop();
    this.micMeter = await this.meters.attach(stream, MIC_THRESHOLD);
    listDevices(this.app.settings);
  }

  applyTrackEnabled() {
    if (!this.micTrack) return;
    // Muted or push-to-talk not held: the track sends silence (packets keep flowing, so the call stays alive).
    this.micTrack.enabled = !this.muted && (!this.app.settings.ptt || this.app.ptt.held);
  }

  setMuted(muted) {
    this.muted = muted;
    this.applyTrackEnabled();
    const b = $("mute-btn");
    b.setAttribute("aria-pressed", String(muted));
    b.querySelector(".ctl-label").textContent = muted ? "Unmute" : "Mute";
    document.documentElement.dataset.muted = muted ? "yes" : "no";
  }

  // ---- camera and screen ------------------------------------------------------------------------------
  async startCamera() {
    try {
      const video = { width: { ideal: 640 }, height: { ideal: 480 }, frameRate: { ideal: 15, max: 30 } };
      if (this.app.settings.camId) video.deviceId = { exact: this.app.settings.camId };
      const stream = await navigator.mediaDevices.getUserMedia({ video });
      this.camTrack?.stop();
      this.camTrack = stream.getVideoTracks()[0];
      this.camOn = true;
      if (!this.screenTrack) await this.showVideo(this.camTrack, "Camera");
    } catch (err) {
      this.camOn = false;
      this.app.alert.show(this.mediaError(err, "camera"));
    }
    this.renderVideoButtons();
    listDevices(this.app.settings);
  }

  stopCamera() {
    this.camTrack?.stop();
    this.camTrack = null;
    this.camOn = false;
    if (!this.screenTrack) this.showVideo(null);
    this.renderVideoButtons();
  }

  toggleCamera() {
    this.camWanted = false;
    return this.camOn ? this.stopCamera() : this.startCamera();
  }

  async toggleScreen() {
    if (this.screenTrack) return this.stopScreen();
    if (!navigator.mediaDevices?.getDisplayMedia) {
      this.app.alert.show({ title: "Screen sharing is not available", text: "This browser cannot share the screen." });
      return;
    }
    try {
      const stream = await navigator.mediaDevices.getDisplayMedia({ video: { frameRate: { max: 5 } }, audio: false });
      this.screenTrack = stream.getVideoTracks()[0];
      this.screenTrack.contentHint = "detail";
      this.screenTrack.addEventListener("ended", () => this.stopScreen());
      await this.showVideo(this.screenTrack, "Screen");
    } catch (err) {
      if (err.name !== "NotAllowedError") this.app.alert.show({ title: "Screen sharing failed", text: err.message });
    }
    this.renderVideoButtons();
  }

  stopScreen() {
    this.screenTrack?.stop();
    this.screenTrack = null;
    this.showVideo(this.camTrack, "Camera");
    this.renderVideoButtons();
  }

  /** The video the call sends: the screen share over the camera. */
  videoTrack() {
    return this.screenTrack || this.camTrack || null;
  }

  async showVideo(track, label) {
    const v = $("local-video");
    v.srcObject = track ? new MediaStream([track]) : null;
    $("selfview").hidden = !track;
    $("selfview").classList.toggle("screen", label === "Screen");
    $("selfview-label").textContent = track ? label : "";
    if (this.app.call) await this.app.call.setVideoTrack(track);
  }

  renderVideoButtons() {
    const cam = $("cam-btn");
    cam.setAttribute("aria-pressed", String(this.camOn));
    cam.querySelector(".ctl-label").textContent = this.camOn ? "Camera on" : "Camera off";
    const screen = $("screen-btn");
    screen.setAttribute("aria-pressed", String(!!this.screenTrack));
    screen.querySelector(".ctl-label").textContent = this.screenTrack ? "Stop share" : "Share";
  }

  // ---- the agent's audio ------------------------------------------------------------------------------
  playRemote(stream) {
    const { alert } = this.app;
    const audio = $("remote-audio");
    audio.srcObject = stream; // Chrome only feeds remote WebRTC audio to WebAudio when an element plays it
    audio.play().catch(() => {
      alert.show({ title: "Sound is blocked", text: "Tap anywhere to hear the agent.", kind: "info" });
      document.addEventListener("pointerdown", () => { audio.play().catch(() => {}); alert.hide(); },
        { once: true });
    });
    this.agentMeter?.stop();
    this.meters.attach(stream, AGENT_THRESHOLD).then((m) => { this.agentMeter = m; });
  }

  /** Microphone, camera, screen and wake lock go when a call is over (no capture indicator left on). */
  release() {
    this.micMeter?.stop();
    this.micMeter = null;
    this.agentMeter?.stop();
    this.agentMeter = null;
    this.micTrack?.stop();
    this.micTrack = null;
    this.micStream = null;
    if (this.screenTrack) this.stopScreen();
    if (this.camTrack) { // the camera goes dark too; it comes back with the next call
      this.stopCamera();
      this.camWanted = true;
    }
    $("remote-audio").srcObject = null;
    this.releaseWake();
    $("mute-btn").disabled = true;
    this.setMuted(false);
  }

  // ---- wake lock --------------------------------------------------------------------------------------
  async keepAwake() {
    if (this.app.mode === "call" || !("wakeLock" in navigator) || document.visibilityState !== "visible") return;
    if (this.wakeLock && !this.wakeLock.released) return;
    try { this.wakeLock = await navigator.wakeLock.request("screen"); } catch { /* battery saver, no support */ }
  }

  releaseWake() {
    this.wakeLock?.release().catch(() => {});
    this.wakeLock = null;
  }

  /** The alert for a microphone or camera (`what`) that would not start, with a "Try again" where it helps. */
  mediaError(err, what) {
    const name = err?.name || "";
    const device = what === "camera" ? "camera" : "microphone";
    const action = { label: "Try again", fn: () => (what === "camera" ? this.startCamera() : this.app.start()) };
    if (name === "NotAllowedError" || name === "SecurityError" || name === "PermissionDeniedError") {
      return {
        title: `${device[0].toUpperCase()}${device.slice(1)} access is blocked`,
        text: `Allow the ${device} for this site (the icon at the left of the address bar, or the browser's site
          settings), then try again.`,
        action,
      };
    }
    if (name === "NotFoundError" || name === "DevicesNotFoundError" || name === "OverconstrainedError") {
      return { title: `No ${device} found`, text: `Connect a ${device}, or pick another one in Settings, then try again.`,
        action };
    }
    if (name === "NotReadableError" || name === "AbortError" || name === "TrackStartError") {
      return { title: `The ${device} is busy`, text: `Another app is using the ${device}. Close it, then try again.`,
        action };
    }
    return { title: `The ${device} could not start`, text: `${name} ${err?.message || ""}`.trim() };
  }
}
