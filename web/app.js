// The call page's App: the page's mode (call, voice, kiosk), the call's lifecycle (start, reconnect, resume,
// hang up), the server's events, the call state shown, and the wiring of the page's parts to the controls:
// settings.js, transcript.js, calls.js, tools.js, latency.js, media.js, stats.js, push-to-talk.js, alert.js.
// call.js is the wire side.
import { Alert } from "./alert.js";
import { apiUrl, Call, ConnectionError, ServerError } from "./call.js";
import { FunctionCalls } from "./calls.js";
import { $, fmtMs } from "./dom.js";
import { Latency } from "./latency.js";
import { Media } from "./media.js";
import { PushToTalk } from "./push-to-talk.js";
import {
  captionsUnavailable, describeUpdate, listDevices, loadSettings, readSettings, resolveMode, saveSettings,
  showServerDefaults, showSettings, storeToken, takeToken, transcription, turnDetection,
} from "./settings.js";
import { Stats } from "./stats.js";
import { Tools } from "./tools.js";
import { Transcript } from "./transcript.js";

const RESUME_RETRY_MS = 1000; // between attempts to resume a call whose connection died

const STATE_TEXT = {
  idle: ["Ready", "Press Start to talk to the agent."],
  connecting: ["Connecting…", "Setting up the call."],
  listening: ["Listening", "Go ahead, I'm listening."],
  hearing: ["Listening", "Hearing you…"],
  thinking: ["Thinking…", "Working on an answer."],
  speaking: ["Speaking", "Talk over me to interrupt."],
  reconnecting: ["Reconnecting…", "The connection dropped; trying again."],
  error: ["Not connected", ""],
  ended: ["Call ended", "Press Start to call again."],
};

class App {
  constructor() {
    this.params = new URLSearchParams(location.search);
    this.settings = loadSettings();
    this.mode = resolveMode(this.params, this.settings);
    this.token = takeToken(this.params);
    this.settings.mode = this.mode;
    saveSettings(this.settings);
    this.video = this.mode === "call";
    this.call = null;
    this.state = "idle";
    this.inCall = false; // between Start and Hang up, reconnects included
    this.textMode = false;
    this.reconnects = 0;
    this.lastResumeMs = null; // how long the last resume took, from the connection's loss to the new one
    this.sessionInfo = null;
    this.events = []; // the server's event types, in order (for diagnostics and tests)
    this._retryTimer = null;
    this.alert = new Alert();
    this.media = new Media(this);
    this.ptt = new PushToTalk(this);
    this.transcript = new Transcript(this);
    this.latency = new Latency(this);
    this.tools = new Tools(this);
    this.functionCalls = new FunctionCalls(this);
    this.stats = new Stats(this);
  }

  // What the console and the browser tests read (window.rtcAgent).
  get micTrack() { return this.media.micTrack; }
  get screenTrack() { return this.media.screenTrack; }
  get turns() { return this.transcript.turns; }
  get responses() { return this.transcript.responses; }
  get pending() { return this.latency.pending; }
  get calls() { return this.functionCalls.calls; }

  // ---- setup ------------------------------------------------------------------------------------------
  init() {
    const { media } = this;
    document.documentElement.dataset.mode = this.mode;
    document.title = { call: "rtc-agent · call", voice: "rtc-agent · voice", kiosk: "rtc-agent" }[this.mode];
    $("call-btn").addEventListener("click", () => (this.inCall ? this.hangup() : this.start()));
    $("mute-btn").addEventListener("click", () => media.setMuted(!media.muted));
    $("cam-btn").addEventListener("click", () => media.toggleCamera());
    $("screen-btn").addEventListener("click", () => media.toggleScreen());
    for (const id of ["settings-btn", "settings-btn-2"]) $(id).addEventListener("click", () => this.openSettings());
    $("settings").addEventListener("close", () => this.closeSettings());
    $("settings-form").addEventListener("submit", (e) => {
      if (e.submitter?.value === "apply" && !this.tools.check()) e.preventDefault(); // the dialog stays open
    });
    this.tools.bind();
    $("alert-close").addEventListener("click", () => this.alert.hide());
    $("token-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.token = $("token-input").value.trim();
      storeToken(this.token);
      $("token-input").value = "";
      this.alert.hide();
      this.config = this.loadConfig();
      this.start();
    });
    this.ptt.bind();
    document.addEventListener("keydown", (e) => this.onKey(e, true));
    document.addEventListener("keyup", (e) => this.onKey(e, false));
    document.addEventListener("pointerdown", () => media.meters.resume(), { capture: true });
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "visible" && this.inCall) media.keepAwake();
    });
    window.addEventListener("pagehide", () => this.call?.hangup());
    navigator.mediaDevices?.addEventListener?.("devicechange", () => listDevices(this.settings));

    showSettings(this.settings, this.mode, this.tools);
    this.render();
    this.config = this.loadConfig();
    if (!this.secure()) {
      this.alert.show({
        title: "This page needs HTTPS",
        text: `Browsers only give the microphone to secure pages. Open https://${location.host}${location.pathname}
          instead (start the server with --self-signed, or --cert and --key), or use http://localhost on the
          server's own computer.`,
      });
    }
    if (this.mode === "kiosk" || this.params.get("autostart") === "1") this.start();
    else if (media.camOn) media.startCamera();
  }

  /** GET api/config: ICE servers, voices, the server's defaults; also tells early that a token is needed. */
  async loadConfig() {
    try {
      const resp = await fetch(apiUrl("api/config"), {
        headers: this.token ? { Authorization: `Bearer ${this.token}` } : {}, cache: "no-store",
      });
      if (resp.status === 401 && !this.inCall) this.alert.show(this.tokenAlert());
      if (!resp.ok) return {};
      const cfg = await resp.json();
      showServerDefaults(cfg, this.settings);
      $("model-note").hidden = cfg.model !== "tiny";
      if (Array.isArray(cfg.output_modalities)) this.setTextMode(cfg.output_modalities[0] === "text");
      if (cfg.input_audio_transcription === null) captionsUnavailable(cfg.input_audio_transcription_note);
      return cfg;
    } catch {
      return {};
    }
  }

  tokenAlert() {
    return {
      title: this.token ? "The access token was not accepted" : "This server needs an access token",
      text: "Open the link with ?token=… that the person running the server gave you, or enter the token here.",
      token: true,
    };
  }

  secure() {
    return window.isSecureContext && !!navigator.mediaDevices?.getUserMedia;
  }

  // ---- the call ---------------------------------------------------------------------------------------
  async start() {
    const { media } = this;
    if (this.inCall) return;
    this.alert.hide();
    if (!this.secure()) {
      this.fail({ title: "This page needs HTTPS", text: `The microphone only works on secure pages. Open
        https://${location.host}${location.pathname} (server flags --self-signed, or --cert and --key).` });
      return;
    }
    this.inCall = true;
    this.reconnects = 0;
    this.setState("connecting");
    media.meters.init();
    try {
      if (!media.micTrack || media.micTrack.readyState === "ended") await media.useMic(await media.openMic());
    } catch (err) {
      this.inCall = false;
      this.fail(media.mediaError(err, "microphone"));
      return;
    }
    if ((media.camOn || media.camWanted) && !media.camTrack) await media.startCamera();
    media.camWanted = false;
    media.keepAwake();
    await this.connect();
  }

  async connect() {
    clearTimeout(this._retryTimer);
    const cfg = (await this.config) || {};
    if (!cfg.ice_servers && this.reconnects) this.config = this.loadConfig(); // the server was down at load
    const call = new Call({
      iceServers: cfg.ice_servers || [],
      token: this.token,
      voice: this.settings.voice || undefined,
      instructions: this.settings.instructions.trim() || undefined,
      micTrack: this.media.micTrack,
      micStream: this.media.micStream,
      video: this.video,
      videoLimits: cfg.video || undefined,
      transcription: this.settings.captions ? undefined : null, // on: the server's default (on where it can)
    });
    this.call = call;
    call.addEventListener("message", (e) => this.onEvent(e.detail));
    call.addEventListener("remotestream", (e) => this.media.playRemote(e.detail));
    call.addEventListener("state", (e) => {
      if (e.detail.state === "lost" && call === this.call) this.onLost(e.detail.reason);
    });
    try {
      await call.start();
    } catch (err) {
      if (call !== this.call) return; // hung up meanwhile
      call.hangup();
      this.call = null;
      this.onStartError(err);
      return;
    }
    if (call !== this.call) return;
    if (this.video) await call.setVideoTrack(this.media.videoTrack());
    if (this.settings.ptt || this.settings.turn) {
      call.updateSession({ turn_detection: await turnDetection(this.settings, this.config) });
    }
    const tools = this.tools.update();
    if (tools.tools.length || tools.tool_choice !== "auto") this.tools.send(tools);
    this.transcript.addNote(this.reconnects ? "Reconnected" : this.transcript.responses.size ? "New call" : "Call started");
    this.reconnects = 0;
    this.alert.hide();
    this.setState("listening");
    $("mute-btn").disabled = false;
    this.stats.start();
  }

  onStartError(err) {
    const kiosk = this.mode === "kiosk";
    if (err instanceof ServerError) {
      if (err.status === 401 || err.status === 403) {
        this.inCall = false;
        this.fail(this.tokenAlert());
        return;
      }
      if (err.status === 503) {
        const wait = Math.max(2, Math.min(60, err.retryAfter ?? 5));
        const when = `${kiosk ? "Trying again" : "Try again"} in ${Math.round(wait)} s.`;
        const info = err.code === "not_ready"
          ? { title: "The agent is starting up", text: `The model is still loading. ${when}` }
          : { title: "The agent is busy", text: `Every line is in use right now. ${when}` };
        if (kiosk) return this.retryLater(wait * 1000, info);
        this.inCall = false;
        this.fail({ ...info, action: { label: "Try again", fn: () => this.start() } });
        return;
      }
      this.inCall = false;
      this.fail({ title: `The server refused the call (${err.status})`, text: err.message });
      return;
    }
    const text = err instanceof ConnectionError ? err.message : `${err.name}: ${err.message}`;
    if (kiosk || this.reconnects > 0) return this.retryLater(this.backoff(), { title: "Connection lost", text });
    this.inCall = false;
    this.fail({
      title: "Can't reach the agent",
      text: `${text} Check that the server is running and reachable from this device.`,
      action: { label: "Try again", fn: () => this.start() },
    });
  }

  backoff() {
    return Math.min(10000, 1000 * 2 ** Math.min(this.reconnects, 4));
  }

  retryLater(ms, info) {
    this.reconnects += 1;
    this.setState("reconnecting");
    this.alert.show({ ...info, kind: "info" });
    clearTimeout(this._retryTimer);
    this._retryTimer = setTimeout(() => { if (this.inCall) this.connect(); }, ms);
  }

  onLost(reason) {
    this.stats.stop();
    this.endAnswerState();
    this.transcript.addNote("Connection lost");
    if (this.call?.resumeToken && this.call.resumeWindowS > 0) this.resumeCall(this.call, reason);
    else this.callEnded(reason);
  }

  /** The call is over on the server too: the kiosk starts a new one, the other modes say so. */
  callEnded(reason) {
    const call = this.call;
    this.call = null;
    this.functionCalls.close();
    call?.hangup();
    if (this.mode === "kiosk") {
      this.retryLater(500, { title: "Connection lost", text: `${reason} Reconnecting…` });
      return;
    }
    this.inCall = false;
    this.media.release();
    this.fail({
      title: "Connection lost",
      text: `${reason} The call has ended.`,
      action: { label: "Reconnect", fn: () => this.start() },
    });
  }

  /**
   * The connection died (the car in a tunnel): the same call over a new peer connection, with the resume token
   * from session.created, tried again and again until the server's resume window is nearly over. The server
   * keeps the conversation meanwhile, so the next answer follows the last one.
   */
  async resumeCall(call, reason) {
    const lostAt = performance.now();
    const deadline = lostAt + call.resumeWindowS * 1000 - RESUME_RETRY_MS;
    this.setState("reconnecting");
    for (let attempt = 1; ; attempt++) {
      this.alert.show({ title: "Connection lost", kind: "info",
        text: `${reason} Reconnecting to the same conversation (attempt ${attempt})…` });
      try {
        await call.resume();
        break;
      } catch (err) {
        if (call !== this.call || !this.inCall) return; // hung up meanwhile
        const refused = err instanceof ServerError && err.status < 500; // 404: the server has ended the call
        if (refused || performance.now() + RESUME_RETRY_MS > deadline) {
          this.callEnded(refused ? "The server no longer has this call." : reason);
          return;
        }
        await new Promise((resolve) => setTimeout(resolve, RESUME_RETRY_MS));
        if (call !== this.call || !this.inCall) return;
      }
    }
    if (call !== this.call || !this.inCall) return;
    this.lastResumeMs = performance.now() - lostAt;
    if (this.video) await call.setVideoTrack(this.media.videoTrack());
    this.transcript.addNote(`Reconnected after ${fmtMs(this.lastResumeMs)}, same conversation`);
    this.alert.hide();
    this.setState("listening");
    this.stats.start();
  }

  async hangup() {
    clearTimeout(this._retryTimer);
    this.inCall = false;
    const call = this.call;
    this.call = null;
    this.stats.stop();
    this.endAnswerState();
    this.ptt.held = false;
    if (call) this.transcript.addNote("Call ended");
    this.functionCalls.close();
    this.media.release();
    this.alert.hide();
    this.setState(call ? "ended" : "idle");
    await call?.hangup();
  }

  fail(info) {
    this.setState("error");
    this.alert.show(info);
    if (!this.inCall) {
      $("mute-btn").disabled = true;
      this.media.releaseWake();
    }
  }

  /** The connection is gone: no answer is being timed, and the turns in progress end where they are. */
  endAnswerState() {
    this.latency.pending = null;
    this.transcript.endLive();
  }

  // ---- server events ----------------------------------------------------------------------------------
  onEvent(msg) {
    const { transcript } = this;
    this.events.push(msg.type);
    if (this.events.length > 500) this.events.splice(0, 100);
    switch (msg.type) {
      case "session.created":
      case "session.updated":
        this.sessionInfo = msg.session ?? null;
        if (Array.isArray(msg.session?.output_modalities)) this.setTextMode(msg.session.output_modalities[0] === "text");
        if (msg.type === "session.updated" && msg.session) this.tools.updated(msg.session);
        if (msg.session?.input_audio_transcription === null) transcript.dropProvisional(); // off: none will complete
        break;
      case "conversation.state":
        if (msg.state === "thinking" && this.state !== "speaking") this.setState("thinking");
        else if (msg.state === "speaking") this.setState("speaking");
        else if (msg.state === "listening" && ["thinking", "speaking"].includes(this.state)) {
          this.setState(transcript.currentUser ? "hearing" : "listening");
        }
        break;
      case "input_audio_buffer.speech_started":
        transcript.userStarted(msg.item_id);
        break;
      case "input_audio_buffer.speech_stopped":
        transcript.userStopped(msg.item_id);
        break;
      case "input_audio_buffer.committed":
        transcript.userCommitted(msg.item_id);
        break;
      case "input_audio_buffer.cleared":
        transcript.userCleared();
        break;
      case "conversation.item.input_audio_transcription.delta":
        transcript.captionPart(msg, false, msg.delta);
        break;
      case "conversation.item.input_audio_transcription.completed":
        transcript.captionPart(msg, true, msg.transcript);
        break;
      case "conversation.item.input_audio_transcription.failed": // that part has no words
        transcript.captionPart(msg, true, "");
        break;
      case "response.created":
        transcript.responseCreated(msg.response?.id ?? `resp_${transcript.responses.size + 1}`);
        break;
      case "response.output_audio_transcript.delta":
      case "response.audio_transcript.delta":
      case "response.output_text.delta": // text mode: the answer is written, not spoken
        transcript.delta(msg.response_id, msg.delta ?? "");
        break;
      case "response.function_call_arguments.delta":
        this.functionCalls.onArguments(msg, false);
        break;
      case "response.function_call_arguments.done":
        this.functionCalls.onArguments(msg, true);
        break;
      case "response.done":
        transcript.responseDone(msg.response ?? {});
        break;
      case "error":
        // The server's complaints about tools name them ("tools[1] (name): …", "tool_choice …").
        if (/^tool/.test(msg.error?.message ?? "")) this.tools.refused(msg.error.message);
        else this.serverError(msg.error ?? {});
        break;
      default:
        break;
    }
  }

  /** Text mode (a server without the Talker, or output_modalities ["text"]): answers are written, not spoken. */
  setTextMode(on) {
    this.textMode = on;
    document.documentElement.dataset.output = on ? "text" : "audio";
    $("text-mode-note").hidden = !on;
  }

  serverError(err) {
    const code = err.code || "";
    if (code === "input_audio_buffer_commit_empty") {
      this.alert.show({ title: "Nothing heard", text: "Hold the talk button while you speak, then let go.", kind: "info",
        autoHide: 4000 });
    } else if (code === "media_process_failed") { // a resumed call, moved to another server process: kept in the log
      this.transcript.addNote(err.message || "The server process of this call stopped; the call goes on in another.");
    } else if (code === "conversation_already_has_active_response") {
      this.alert.show({ title: "The agent is still answering", text: "Wait for the answer, or talk over it.",
        kind: "info", autoHide: 4000 });
    } else {
      this.alert.show({ title: "The agent reported a problem", text: err.message || code, kind: "info", autoHide: 8000 });
    }
  }

  /** Space: push-to-talk (when on); M: mute. Not while typing, nor with the settings open. */
  onKey(e, down) {
    const t = e.target;
    const typing = t instanceof HTMLElement && (t.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(t.tagName));
    if (typing || $("settings").open || e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.code === "Space" && this.settings.ptt && this.call) {
      e.preventDefault(); // no scrolling, no click on the focused button
      if (down && !e.repeat) this.ptt.down();
      else if (!down) this.ptt.up();
    } else if (down && !e.repeat && (e.key === "m" || e.key === "M") && this.inCall) {
      this.media.setMuted(!this.media.muted);
    }
  }

  // ---- settings dialog --------------------------------------------------------------------------------
  openSettings() {
    showSettings(this.settings, this.mode, this.tools);
    listDevices(this.settings);
    this.stats.render();
    const d = $("settings");
    if (!d.open) d.showModal();
  }

  /** Apply: the settings are saved, and what changed goes to the call, the microphone and the camera. */
  async closeSettings() {
    const { media } = this;
    const d = $("settings");
    if (d.returnValue !== "apply") return;
    d.returnValue = "";
    const s = this.settings;
    const before = { ...s };
    const mode = readSettings(s, this.mode);
    if (mode !== this.mode) {
      const url = new URL(location.href);
      url.searchParams.set("mode", mode);
      url.searchParams.delete("autostart");
      await this.hangup();
      location.assign(url);
      return;
    }
    // The tools go first, in a message of their own: when the server refuses them, the rest still applies.
    // (Without a call they go when the next one starts.)
    if (s.tools !== before.tools || s.toolChoice !== before.toolChoice || this.tools.error) {
      this.tools.send(this.tools.update());
    }
    showSettings(s, this.mode, this.tools);
    if (this.call) {
      const update = {};
      if (s.voice !== before.voice && s.voice) update.voice = s.voice;
      if (s.instructions !== before.instructions) update.instructions = s.instructions;
      if (s.ptt !== before.ptt || s.turn !== before.turn) update.turn_detection = await turnDetection(s, this.config);
      if (s.captions !== before.captions) update.input_audio_transcription = await transcription(s, this.config);
      if (Object.keys(update).length) {
        this.call.updateSession(update);
        this.transcript.addNote(describeUpdate(update));
      }
    }
    if (media.micTrack && (s.processing !== before.processing || s.micId !== before.micId)) {
      try {
        await media.useMic(await media.openMic());
      } catch (err) {
        this.alert.show(media.mediaError(err, "microphone"));
      }
    }
    media.applyTrackEnabled();
    if (media.camOn && s.camId !== before.camId) await media.startCamera();
  }

  // ---- rendering --------------------------------------------------------------------------------------
  setState(state) {
    this.state = state;
    document.documentElement.dataset.state = state;
    const [word, hint] = STATE_TEXT[state] ?? [state, ""];
    $("status-text").textContent = word;
    $("state-word").textContent = word;
    $("state-hint").textContent = this.settings.ptt && ["listening", "speaking"].includes(state)
      ? `Hold ${this.mode === "kiosk" ? "the button" : "the talk button or Space"} while you speak.`
      : hint;
    this.render();
  }

  render() {
    const live = this.inCall;
    const b = $("call-btn");
    b.classList.toggle("end", live);
    const label = live ? (this.state === "reconnecting" ? "Cancel" : "Hang up") : this.state === "error" ? "Try again" : "Start";
    $("call-label").textContent = label;
    b.setAttribute("aria-label", live ? "Hang up" : "Start call");
    $("ptt-btn").disabled = !this.call;
    this.media.renderVideoButtons();
  }
}

const app = new App();
window.rtcAgent = app; // for the console and the browser tests
app.init();
