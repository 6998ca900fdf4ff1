// The conversation log: the caller's turns with the captions of their words (provisional, then final; the
// kiosk's large caption line), the agent's answers as their text streams in, notes, and keeping it scrolled.
import { $, el, fmtMs, tail } from "./dom.js";

const CAPTION_LINGER_MS = 4000; // the kiosk's caption line stays this long after its words are final
const CAPTION_FADE_MS = 800; // then fades out (style.css: .kiosk-caption.fade)

/** The transcript of the App `app` (its state, settings, media, latency and function calls). */
export class Transcript {
  constructor(app) {
    this.app = app;
    this.turns = []; // finished answers: {id, text, interrupted, ttfp_ms, heard_ms, frames, audio_s}
    this.responses = new Map(); // answers by response id: {id, li, text, done, calls, ...}
    this.current = null; // the answer being given
    this.userTurns = new Map(); // the caller's turns by item_id: {id, li, parts, live, startedAt, spokeS, dropped}
    this.currentUser = null; // the one the caller is speaking
    this.lastUser = null; // the newest one shown (the kiosk's caption line)
    this._captionTimer = null; // the kiosk's caption line fading
  }

  // ---- the caller's turns and their captions ----------------------------------------------------------
  /** The caller's turn (conversation item) `id`; its captions may come before its entry is shown, or after. */
  userTurn(id) {
    let u = id && this.userTurns.get(id);
    if (!u) {
      u = { id, li: null, parts: [], live: false, startedAt: null, spokeS: null, dropped: false };
      if (id) this.userTurns.set(id, u);
    }
    return u;
  }

  /** The turn's entry in the transcript (a new one goes below the others, so above the answer to it). */
  showUser(u) {
    if (!u.li) {
      u.li = this.addItem("user", "You");
      if (u.id) u.li.dataset.itemId = u.id;
      this.lastUser = u;
    }
    this.renderUser(u);
  }

  userStarted(id) {
    if (this.currentUser) return;
    const u = this.userTurn(id);
    Object.assign(u, { live: true, startedAt: performance.now() });
    this.currentUser = u;
    this.showUser(u);
    if (this.app.state === "listening") this.app.setState("hearing");
  }

  userStopped(id) {
    if (!this.currentUser) this.userStarted(id);
    const u = this.currentUser;
    this.currentUser = null;
    const lastLoud = this.app.media.micMeter?.lastLoud;
    const end = lastLoud && performance.now() - lastLoud < 5000 ? lastLoud : performance.now();
    Object.assign(u, { live: false, spokeS: Math.max(0.1, (end - u.startedAt) / 1000) });
    this.renderUser(u);
    this.app.latency.arm(end);
  }

  /** A push-to-talk commit may come with no speech_started: its turn is shown now, before the answer. */
  userCommitted(id) {
    const u = this.userTurn(id);
    if (!u.li && !u.dropped) this.showUser(u);
  }

  /** The turn being spoken was dropped: its entry goes, and captions still coming for it are not shown. */
  userCleared() {
    const u = this.currentUser;
    if (!u) return;
    this.currentUser = null;
    Object.assign(u, { dropped: true, parts: [] });
    u.li.remove();
    if (this.lastUser === u) this.renderKioskCaption("", false);
    if (this.app.state === "hearing") this.app.setState("listening");
  }

  /** A caption event: provisional words appended to part `content_index`, or its final text replacing them. */
  captionPart({ item_id: id, content_index: index = 0 }, final, text) {
    const u = this.userTurn(id);
    if (u.dropped || u.parts[index]?.final) return;
    const before = final ? "" : u.parts[index]?.text ?? "";
    u.parts[index] = { text: before + (text ?? ""), final };
    this.renderUser(u);
  }

  /** Captions that will not be completed (the call, or its captions, ended): their provisional words go. */
  dropProvisional() {
    for (const u of this.userTurns.values()) {
      if (!u.parts.some((p) => p && !p.final)) continue;
      u.parts = u.parts.map((p) => (p?.final ? p : null));
      this.renderUser(u);
    }
  }

  /**
   * The entry: the caption (provisional words in their own style) or what the caller is doing; under a caption,
   * how long they spoke.
   */
  renderUser(u) {
    if (!u.li) return;
    const parts = u.parts.filter((p) => p?.text.trim());
    const provisional = parts.some((p) => !p.final);
    const caption = parts.map((p) => p.text.trim()).join(" ");
    const text = u.li.querySelector(".text");
    text.replaceChildren(...(parts.length ? captionNodes(parts) : [this.userStatus(u)]));
    u.li.classList.toggle("live", u.live);
    u.li.classList.toggle("captioned", !!caption);
    if (provisional) u.li.setAttribute("aria-busy", "true"); // words may still change: read the final ones
    else u.li.removeAttribute("aria-busy");
    let meta = u.li.querySelector(".meta");
    if (!meta) meta = u.li.appendChild(el("p", "meta"));
    meta.textContent = caption && u.spokeS != null ? spokeFor(u.spokeS) : "";
    meta.hidden = !meta.textContent;
    if (u === this.lastUser) this.renderKioskCaption(caption, provisional);
  }

  userStatus(u) {
    if (u.live) return this.app.settings.ptt ? "Talking… release to send" : "Speaking…";
    return u.spokeS != null ? spokeFor(u.spokeS) : "Spoke";
  }

  /** The kiosk's large caption line: the newest caption's last words, gone a few seconds after they are final. */
  renderKioskCaption(caption, provisional) {
    const line = $("kiosk-caption");
    clearTimeout(this._captionTimer);
    line.textContent = tail(caption, 80);
    line.classList.toggle("provisional", provisional);
    line.classList.remove("fade");
    if (!caption || provisional) return;
    this._captionTimer = setTimeout(() => {
      line.classList.add("fade");
      this._captionTimer = setTimeout(() => { line.textContent = ""; }, CAPTION_FADE_MS);
    }, CAPTION_LINGER_MS);
  }

  // ---- the agent's answers ----------------------------------------------------------------------------
  /** The answer `id`, or the one being given. */
  response(id) {
    return (id && this.responses.get(id)) || this.current;
  }

  responseCreated(id) {
    const { app } = this;
    if (this.currentUser) this.userStopped(); // push-to-talk commits may come without speech_stopped
    if (!app.latency.pending || app.latency.pending.responseId) app.latency.arm(app.ptt.releasedAt ?? performance.now());
    const pending = app.latency.pending;
    pending.responseId = id;
    const li = this.addItem("agent", "Agent");
    li.setAttribute("aria-busy", "true");
    li.classList.add("live");
    li.querySelector(".text").textContent = "";
    li.querySelector(".text").classList.add("waiting");
    const r = { id, li, text: "", interrupted: false, ttfp_ms: null, heard_ms: null, done: false, calls: [],
      continued: false };
    $("kiosk-line").textContent = "";
    this.responses.set(id, r);
    this.current = r;
    if (app.state !== "speaking") app.setState("thinking");
    if (pending.heardMs != null) this.showHeard(pending);
  }

  delta(id, delta) {
    const r = this.response(id);
    if (!r || r.done) return;
    r.text += delta;
    const text = r.li.querySelector(".text");
    text.classList.remove("waiting");
    text.hidden = false;
    text.textContent = r.text;
    $("kiosk-line").textContent = tail(r.text, 160);
    this.scrollLog();
  }

  responseDone(resp) {
    const { app } = this;
    const r = this.response(resp.id);
    if (!r) return;
    const m = resp.metrics ?? {};
    r.done = true;
    r.interrupted = !!(resp.interrupted ?? m.interrupted ?? resp.status === "cancelled");
    r.failed = resp.status === "failed";
    r.ttfp_ms = typeof m.ttfp_ms === "number" ? m.ttfp_ms : null;
    r.ttft_ms = typeof m.ttft_ms === "number" ? m.ttft_ms : null;
    if (!r.text && resp.transcript) r.text = resp.transcript;
    const text = r.li.querySelector(".text");
    text.classList.remove("waiting");
    text.textContent = r.text || (r.interrupted ? "" : "(no words)");
    text.hidden = !r.text && r.calls.length > 0; // an answer of calls only: the calls say it
    for (const call of r.calls) if (!call.done) app.functionCalls.cut(call);
    r.li.classList.remove("live");
    r.li.removeAttribute("aria-busy");
    r.li.classList.toggle("cut", r.interrupted);
    if (r.interrupted) {
      text.after(el("span", "cut-tag", "interrupted"));
      r.li.setAttribute("aria-label", `Agent (interrupted): ${r.text}`);
    }
    if (r.failed) r.li.classList.add("failed");
    const pending = app.latency.pending;
    if (pending?.responseId === r.id) r.heard_ms = pending.heardMs;
    this.renderMeta(r);
    this.turns.push({ id: r.id, text: r.text, interrupted: r.interrupted, ttfp_ms: r.ttfp_ms, heard_ms: r.heard_ms,
      frames: m.frames ?? null, audio_s: m.audio_s ?? null });
    app.latency.show(r);
    app.functionCalls.continueAfter(r);
    if (this.current === r) this.current = null;
    if (["thinking", "speaking"].includes(app.state)) {
      // The last packets still play for a moment after the server is done with them.
      setTimeout(() => {
        if (["thinking", "speaking"].includes(app.state) && !this.current) {
          app.setState(this.currentUser ? "hearing" : "listening");
        }
      }, r.interrupted ? 0 : 250);
    }
  }

  /** The first answer audio of `pending`'s answer was heard. */
  showHeard(pending) {
    const r = pending.responseId && this.responses.get(pending.responseId);
    if (!r) return;
    r.heard_ms = pending.heardMs;
    const turn = this.turns.find((t) => t.id === r.id); // the audio may be heard after response.done
    if (turn) turn.heard_ms = r.heard_ms;
    this.renderMeta(r);
    this.app.latency.show(r);
  }

  renderMeta(r) {
    let meta = r.li.querySelector(".meta");
    if (!meta) meta = r.li.appendChild(el("p", "meta"));
    const parts = [];
    if (r.heard_ms != null) parts.push(`heard after ${fmtMs(r.heard_ms)}`);
    if (r.ttfp_ms != null) parts.push(`server first packet ${fmtMs(r.ttfp_ms)}`);
    else if (this.app.textMode && r.ttft_ms != null) parts.push(`first text ${fmtMs(r.ttft_ms)}`);
    meta.textContent = parts.join(" · ");
    meta.hidden = !parts.length;
  }

  /** The connection is gone: the caller's turn and the answers in progress end where they are. */
  endLive() {
    if (this.currentUser) {
      this.currentUser.live = false;
      this.renderUser(this.currentUser);
      this.currentUser = null;
    }
    this.dropProvisional(); // no more words come for them
    for (const r of this.responses.values()) {
      if (!r.done) {
        r.done = true;
        r.li.classList.remove("live");
        r.li.removeAttribute("aria-busy");
      }
    }
    this.current = null;
  }

  // ---- the log ----------------------------------------------------------------------------------------
  addItem(role, who) {
    const li = el("li", `turn ${role}`);
    li.append(el("span", "who", who), el("p", "text"));
    $("log").append(li);
    $("log-empty").hidden = true;
    this.scrollLog(true);
    return li;
  }

  addNote(text) {
    $("log").append(el("li", "note", text));
    $("log-empty").hidden = true;
    this.scrollLog(true);
  }

  scrollLog(force = false) {
    const scroller = $("log").closest(".transcript");
    const near = scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 120;
    if (force || near) scroller.scrollTop = scroller.scrollHeight;
  }
}

/** A caption's parts as text, each provisional part in a span of its own (shown muted). */
function captionNodes(parts) {
  return parts.flatMap((p, i) => {
    const words = p.text.trim();
    const node = p.final ? document.createTextNode(words) : el("span", "provisional", words);
    return i ? [" ", node] : [node];
  });
}

function spokeFor(secs) {
  return `Spoke for ${secs.toFixed(1)} s`;
}
