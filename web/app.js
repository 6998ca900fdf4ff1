// The call page: modes (call, voice, kiosk), controls, transcript, latency, errors. See call.js for the wire side.
import { apiUrl, Call, ConnectionError, ServerError } from "./call.js";
import { Meters } from "./meter.js";

const MODES = ["call", "voice", "kiosk"];
const STORE = "rtc-agent.settings";
const TOKEN_KEY = "rtc-agent.token";
const MIC_THRESHOLD = 0.01; // caller speech (RMS) for the end-of-speech time
const AGENT_THRESHOLD = 0.0005; // first answer audio (about -66 dBFS RMS: decoded silence is far below)
const PTT_TAIL_MS = 150; // keep sending this long after release so the last syllable reaches the server first
const CAPTION_LINGER_MS = 4000; // the kiosk's caption line stays this long after its words are final
const CAPTION_FADE_MS = 800; // then fades out (style.css: .kiosk-caption.fade)
const RESUME_RETRY_MS = 1000; // between attempts to resume a call whose connection died
const MAX_TOOLS_CHARS = 60000; // the server takes data-channel messages of at most 64 KiB
const TOOL_RESULT = '{"ok": true}'; // what a call's result box starts with
// "Fill in an example": two tools whose strings are bounded (maxLength), so that a call fits in an answer
const EXAMPLE_TOOLS = [
  { type: "function", name: "set_heating", description: "Set the seat heating of one row of the car.",
    parameters: { type: "object", required: ["zone", "level"], properties: {
      zone: { type: "string", enum: ["front", "back"] }, level: { type: "integer", minimum: 0, maximum: 5 } } } },
  { type: "function", name: "add_to_list", description: "Add items to the shopping list.",
    parameters: { type: "object", required: ["items"], properties: {
      items: { type: "array", items: { type: "string", maxLength: 20 }, minItems: 1, maxItems: 3 } } } },
];
const $ = (id) => document.getElementById(id);

// ---- settings, mode, token ------------------------------------------------------------------------------
function loadSettings() {
  const defaults = { voice: "", instructions: "", processing: true, ptt: false, turn: "", micId: "", camId: "",
    mode: "", tools: "", toolChoice: "auto", captions: true };
  try {
    return { ...defaults, ...JSON.parse(localStorage.getItem(STORE) || "{}") };
  } catch {
    return defaults;
  }
}

function saveSettings(s) {
  try { localStorage.setItem(STORE, JSON.stringify(s)); } catch { /* private mode */ }
}

/** The tools box's text: {tools} (a list; empty text is none) or {error}, said for the box. */
function parseTools(text) {
  const src = text.trim();
  if (!src) return { tools: [] };
  if (src.length > MAX_TOOLS_CHARS) return { error: `The tools are too long (at most ${MAX_TOOLS_CHARS} characters).` };
  let tools;
  try {
    tools = JSON.parse(src);
  } catch (err) {
    return { error: `Not valid JSON: ${err.message}` };
  }
  if (!Array.isArray(tools)) return { error: 'The tools must be a JSON list: [{"type": "function", "name": …}, …]' };
  return { tools };
}

function toolNames(tools) {
  return [...new Set(tools.filter((t) => typeof t?.name === "string" && t.name).map((t) => t.name))];
}

/** The tool choice select's value as session.update takes it: "auto", "none", "required" or a named function. */
function toolChoice(value) {
  return value.startsWith("function:") ? { type: "function", name: value.slice("function:".length) } : value;
}

function choiceText(choice) {
  return typeof choice === "object" && choice ? `always ${choice.name}` : String(choice);
}

function resolveMode(params, settings) {
  const asked = (params.get("mode") || "").toLowerCase();
  if (MODES.includes(asked)) return asked;
  if (MODES.includes(settings.mode)) return settings.mode;
  const phone = matchMedia("(pointer: coarse) and (max-width: 640px)").matches;
  return phone ? "voice" : "call";
}

/** ?token= moves into sessionStorage and out of the address bar (history, screenshots, shared links). */
function takeToken(params) {
  let token = "";
  try { token = sessionStorage.getItem(TOKEN_KEY) || ""; } catch { /* no storage */ }
  if (params.has("token")) {
    token = params.get("token") || "";
    try { sessionStorage.setItem(TOKEN_KEY, token); } catch { /* no storage */ }
    const url = new URL(location.href);
    url.searchParams.delete("token");
    history.replaceState(null, "", url);
  }
  return token;
}

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
    this.meters = new Meters();
    this.call = null;
    this.state = "idle";
    this.inCall = false; // between Start and Hang up, reconnects included
    this.micStream = null;
    this.micTrack = null;
    this.micMeter = null;
    this.agentMeter = null;
    this.camTrack = null;
    this.screenTrack = null;
    this.camOn = this.video && this.params.get("video") === "1";
    this.muted = false;
    this.pttHeld = false;
    this.wakeLock = null;
    this.turns = []; // finished answers: {id, text, interrupted, ttfp_ms, heard_ms}
    this.responses = new Map();
    this.userTurns = new Map(); // the caller's turns by item_id: {id, li, parts, live, startedAt, spokeS, dropped}
    this.currentUser = null; // the one the caller is speaking
    this.lastUser = null; // the newest one shown (the kiosk's caption line)
    this.pending = null; // {ref: perf ms of the caller's end of speech, heardMs, onsetAt}
    this.reconnects = 0;
    this.lastResumeMs = null; // how long the last resume took, from the connection's loss to the new one
    this.sessionInfo = null;
    this.events = []; // the server's event types, in order (for diagnostics and tests)
    this.calls = new Map(); // function calls by call_id: {id, name, args, done, cut, sent, responseId, ...}
    this.toolsSent = null; // the tools update on its way to the server, until session.updated or its error
    this.toolsError = ""; // the server's refusal of the last tools update, shown next to the box
    this._retryTimer = null;
    this._captionTimer = null; // the kiosk's caption line fading
    this._statsTimer = null;
    this._raf = 0;
  }

  // ---- setup ------------------------------------------------------------------------------------------
  init() {
    document.documentElement.dataset.mode = this.mode;
    document.title = { call: "rtc-agent · call", voice: "rtc-agent · voice", kiosk: "rtc-agent" }[this.mode];
    $("call-btn").addEventListener("click", () => (this.inCall ? this.hangup() : this.start()));
    $("mute-btn").addEventListener("click", () => this.setMuted(!this.muted));
    $("cam-btn").addEventListener("click", () => this.toggleCamera());
    $("screen-btn").addEventListener("click", () => this.toggleScreen());
    for (const id of ["settings-btn", "settings-btn-2"]) $(id).addEventListener("click", () => this.openSettings());
    $("settings").addEventListener("close", () => this.closeSettings());
    $("settings-form").addEventListener("submit", (e) => {
      if (e.submitter?.value === "apply" && !this.checkTools()) e.preventDefault(); // the dialog stays open
    });
    $("tools").addEventListener("input", () => this.onToolsInput());
    $("tools-example").addEventListener("click", () => {
      $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
      this.onToolsInput();
    });
    $("alert-close").addEventListener("click", () => this.hideAlert());
    $("token-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.token = $("token-input").value.trim();
      try { sessionStorage.setItem(TOKEN_KEY, this.token); } catch { /* no storage */ }
      $("token-input").value = "";
      this.hideAlert();
      this.config = this.loadConfig();
      this.start();
    });
    this.bindPushToTalk();
    document.addEventListener("keydown", (e) => this.onKey(e, true));
    document.addEventListener("keyup", (e) => this.onKey(e, false));
    document.addEventListener("pointerdown", () => this.meters.resume(), { capture: true });
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "visible" && this.inCall) this.keepAwake();
    });
    window.addEventListener("pagehide", () => this.call?.hangup());
    navigator.mediaDevices?.addEventListener?.("devicechange", () => this.listDevices());

    this.applySettingsToUi();
    this.render();
    this.config = this.loadConfig();
    if (!this.secure()) {
      this.showAlert({
        title: "This page needs HTTPS",
        text: `Browsers only give the microphone to secure pages. Open https://${location.host}${location.pathname}
          instead (start the server with --self-signed, or --cert and --key), or use http://localhost on the
          server's own computer.`,
      });
    }
    if (this.mode === "kiosk" || this.params.get("autostart") === "1") this.start();
    else if (this.camOn) this.startCamera();
  }

  /** GET api/config: ICE servers, voices, the server's defaults; also tells early that a token is needed. */
  async loadConfig() {
    try {
      const resp = await fetch(apiUrl("api/config"), {
        headers: this.token ? { Authorization: `Bearer ${this.token}` } : {}, cache: "no-store",
      });
      if (resp.status === 401 && !this.inCall) {
        this.showAlert({
          title: this.token ? "The access token was not accepted" : "This server needs an access token",
          text: "Open the link with ?token=… that the person running the server gave you, or enter the token here.",
          token: true,
        });
      }
      if (!resp.ok) return {};
      const cfg = await resp.json();
      if (Array.isArray(cfg.voices) && cfg.voices.length) {
        const select = $("voice");
        select.replaceChildren(...cfg.voices.map((v) => new Option(v[0].toUpperCase() + v.slice(1), v)));
        select.value = this.settings.voice || cfg.voice || cfg.voices[0];
      }
      if (cfg.instructions) $("instructions").placeholder = cfg.instructions;
      $("model-note").hidden = cfg.model !== "tiny";
      if (Array.isArray(cfg.output_modalities)) this.setTextMode(cfg.output_modalities[0] === "text");
      if (cfg.input_audio_transcription === null) this.captionsUnavailable(cfg.input_audio_transcription_note);
      return cfg;
    } catch {
      return {};
    }
  }

  /** The server has no speech recogniser: the captions setting is off and says why. */
  captionsUnavailable(note) {
    $("captions").disabled = true;
    $("captions").checked = false;
    $("captions-help").textContent = note || "This server makes no captions.";
    $("captions-help").hidden = false;
  }

  secure() {
    return window.isSecureContext && !!navigator.mediaDevices?.getUserMedia;
  }

  applySettingsToUi() {
    const s = this.settings;
    if (s.voice) $("voice").value = s.voice;
    $("instructions").value = s.instructions;
    $("processing").checked = s.processing;
    $("ptt").checked = s.ptt;
    $("captions").checked = s.captions && !$("captions").disabled; // (disabled: the server makes none)
    $("turn").value = s.turn;
    $("tools").value = s.tools;
    this.fillToolChoice(toolNames(parseTools(s.tools).tools ?? []), s.toolChoice);
    this.showToolsError(this.toolsError);
    $("ptt-btn").hidden = !s.ptt;
    document.documentElement.dataset.ptt = s.ptt ? "on" : "off";
    for (const r of document.querySelectorAll('input[name="mode"]')) r.checked = r.value === this.mode;
  }

  // ---- microphone and camera --------------------------------------------------------------------------
  audioConstraints() {
    const p = this.settings.processing;
    const c = { echoCancellation: p, noiseSuppression: p, autoGainControl: p, channelCount: 1 };
    if (this.settings.micId) c.deviceId = { exact: this.settings.micId };
    return c;
  }

  async openMic() {
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: this.audioConstraints() });
    } catch (err) {
      if (this.settings.micId && (err.name === "OverconstrainedError" || err.name === "NotFoundError")) {
        this.settings.micId = ""; // the saved microphone is gone: take the default one
        saveSettings(this.settings);
        stream = await navigator.mediaDevices.getUserMedia({ audio: this.audioConstraints() });
      } else {
        throw err;
      }
    }
    const track = stream.getAudioTracks()[0];
    if (!track) throw Object.assign(new Error("no audio track"), { name: "NotFoundError" });
    track.addEventListener("ended", () => {
      if (this.inCall) this.showAlert({ title: "Microphone disconnected", text: "Pick another microphone in Settings.",
        action: { label: "Settings", fn: () => this.openSettings() } });
    });
    return { stream, track };
  }

  async useMic({ stream, track }) {
    const old = this.micTrack;
    this.micStream = stream;
    this.micTrack = track;
    this.applyTrackEnabled();
    if (this.call) await this.call.replaceMicTrack(track, stream);
    if (old && old !== track) old.stop();
    this.micMeter?.stop();
    this.micMeter = await this.meters.attach(stream, MIC_THRESHOLD);
    this.listDevices();
  }

  applyTrackEnabled() {
    if (!this.micTrack) return;
    // Muted or push-to-talk not held: the track sends silence (packets keep flowing, so the call stays alive).
    this.micTrack.enabled = !this.muted && (!this.settings.ptt || this.pttHeld);
  }

  setMuted(muted) {
    this.muted = muted;
    this.applyTrackEnabled();
    const b = $("mute-btn");
    b.setAttribute("aria-pressed", String(muted));
    b.querySelector(".ctl-label").textContent = muted ? "Unmute" : "Mute";
    document.documentElement.dataset.muted = muted ? "yes" : "no";
  }

  async startCamera() {
    try {
      const video = { width: { ideal: 640 }, height: { ideal: 480 }, frameRate: { ideal: 15, max: 30 } };
      if (this.settings.camId) video.deviceId = { exact: this.settings.camId };
      const stream = await navigator.mediaDevices.getUserMedia({ video });
      this.camTrack?.stop();
      this.camTrack = stream.getVideoTracks()[0];
      this.camOn = true;
      if (!this.screenTrack) await this.showVideo(this.camTrack, "Camera");
    } catch (err) {
      this.camOn = false;
      this.showAlert(this.mediaError(err, "camera"));
    }
    this.renderVideoButtons();
    this.listDevices();
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
      this.showAlert({ title: "Screen sharing is not available", text: "This browser cannot share the screen." });
      return;
    }
    try {
      const stream = await navigator.mediaDevices.getDisplayMedia({ video: { frameRate: { max: 5 } }, audio: false });
      this.screenTrack = stream.getVideoTracks()[0];
      this.screenTrack.contentHint = "detail";
      this.screenTrack.addEventListener("ended", () => this.stopScreen());
      await this.showVideo(this.screenTrack, "Screen");
    } catch (err) {
      if (err.name !== "NotAllowedError") this.showAlert({ title: "Screen sharing failed", text: err.message });
    }
    this.renderVideoButtons();
  }

  stopScreen() {
    this.screenTrack?.stop();
    this.screenTrack = null;
    this.showVideo(this.camTrack, "Camera");
    this.renderVideoButtons();
  }

  async showVideo(track, label) {
    const v = $("local-video");
    v.srcObject = track ? new MediaStream([track]) : null;
    $("selfview").hidden = !track;
    $("selfview").classList.toggle("screen", label === "Screen");
    $("selfview-label").textContent = track ? label : "";
    if (this.call) await this.call.setVideoTrack(track);
  }

  renderVideoButtons() {
    const cam = $("cam-btn");
    cam.setAttribute("aria-pressed", String(this.camOn));
    cam.querySelector(".ctl-label").textContent = this.camOn ? "Camera on" : "Camera off";
    const screen = $("screen-btn");
    screen.setAttribute("aria-pressed", String(!!this.screenTrack));
    screen.querySelector(".ctl-label").textContent = this.screenTrack ? "Stop share" : "Share";
  }

  async listDevices() {
    if (!navigator.mediaDevices?.enumerateDevices) return;
    let devices;
    try { devices = await navigator.mediaDevices.enumerateDevices(); } catch { return; }
    const fill = (select, kind, current, fallback) => {
      const list = devices.filter((d) => d.kind === kind && d.deviceId && d.deviceId !== "default");
      select.replaceChildren(new Option(fallback, ""),
        ...list.map((d, i) => new Option(d.label || `${fallback.replace("Default ", "")} ${i + 1}`, d.deviceId)));
      select.value = list.some((d) => d.deviceId === current) ? current : "";
    };
    fill($("mic-select"), "audioinput", this.settings.micId, "Default microphone");
    fill($("cam-select"), "videoinput", this.settings.camId, "Default camera");
  }

  // ---- the call ---------------------------------------------------------------------------------------
  async start() {
    if (this.inCall) return;
    this.hideAlert();
    if (!this.secure()) {
      this.fail({ title: "This page needs HTTPS", text: `The microphone only works on secure pages. Open
        https://${location.host}${location.pathname} (server flags --self-signed, or --cert and --key).` });
      return;
    }
    this.inCall = true;
    this.reconnects = 0;
    this.setState("connecting");
    this.meters.init();
    try {
      if (!this.micTrack || this.micTrack.readyState === "ended") await this.useMic(await this.openMic());
    } catch (err) {
      this.inCall = false;
      this.fail(this.mediaError(err, "microphone"));
      return;
    }
    if ((this.camOn || this.camWanted) && !this.camTrack) await this.startCamera();
    this.camWanted = false;
    this.keepAwake();
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
      micTrack: this.micTrack,
      micStream: this.micStream,
      video: this.video,
      videoLimits: cfg.video || undefined,
      transcription: this.settings.captions ? undefined : null, // on: the server's default (on where it can)
    });
    this.call = call;
    call.addEventListener("message", (e) => this.onEvent(e.detail));
    call.addEventListener("remotestream", (e) => this.onRemoteStream(e.detail));
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
    if (this.video) await call.setVideoTrack(this.screenTrack || this.camTrack || null);
    if (this.settings.ptt || this.settings.turn) {
      call.updateSession({ turn_detection: await this.turnDetection() });
    }
    const tools = this.toolsUpdate();
    if (tools.tools.length || tools.tool_choice !== "auto") this.sendTools(tools);
    this.addNote(this.reconnects ? "Reconnected" : this.responses.size ? "New call" : "Call started");
    this.reconnects = 0;
    this.hideAlert();
    this.setState("listening");
    $("mute-btn").disabled = false;
    this.startStats();
  }

  onStartError(err) {
    const kiosk = this.mode === "kiosk";
    if (err instanceof ServerError) {
      if (err.status === 401 || err.status === 403) {
        this.inCall = false;
        this.fail({
          title: this.token ? "The access token was not accepted" : "This server needs an access token",
          text: "Open the link with ?token=… that the person running the server gave you, or enter the token here.",
          token: true,
        });
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
    this.showAlert({ ...info, kind: "info" });
    clearTimeout(this._retryTimer);
    this._retryTimer = setTimeout(() => { if (this.inCall) this.connect(); }, ms);
  }

  onLost(reason) {
    this.stopStats();
    this.endAnswerState();
    this.addNote("Connection lost");
    if (this.call?.resumeToken && this.call.resumeWindowS > 0) this.resumeCall(this.call, reason);
    else this.callEnded(reason);
  }

  /** The call is over on the server too: the kiosk starts a new one, the other modes say so. */
  callEnded(reason) {
    const call = this.call;
    this.call = null;
    this.closeCalls();
    call?.hangup();
    if (this.mode === "kiosk") {
      this.retryLater(500, { title: "Connection lost", text: `${reason} Reconnecting…` });
      return;
    }
    this.inCall = false;
    this.releaseMedia();
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
      this.showAlert({ title: "Connection lost", kind: "info",
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
    if (this.video) await call.setVideoTrack(this.screenTrack || this.camTrack || null);
    this.addNote(`Reconnected after ${fmtMs(this.lastResumeMs)}, same conversation`);
    this.hideAlert();
    this.setState("listening");
    this.startStats();
  }

  async hangup() {
    clearTimeout(this._retryTimer);
    this.inCall = false;
    const call = this.call;
    this.call = null;
    this.stopStats();
    this.endAnswerState();
    if (this.pttHeld) this.pttHeld = false;
    if (call) this.addNote("Call ended");
    this.closeCalls();
    this.releaseMedia();
    this.hideAlert();
    this.setState(call ? "ended" : "idle");
    await call?.hangup();
  }

  /** Microphone, camera, screen and wake lock go when a call is over (no capture indicator left on). */
  releaseMedia() {
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

  fail(info) {
    this.setState("error");
    this.showAlert(info);
    if (!this.inCall) {
      $("mute-btn").disabled = true;
      this.releaseWake();
    }
  }

  mediaError(err, what) {
    const name = err?.name || "";
    const device = what === "camera" ? "camera" : "microphone";
    if (name === "NotAllowedError" || name === "SecurityError" || name === "PermissionDeniedError") {
      return {
        title: `${device[0].toUpperCase()}${device.slice(1)} access is blocked`,
        text: `Allow the ${device} for this site (the icon at the left of the address bar, or the browser's site
          settings), then try again.`,
        action: { label: "Try again", fn: () => (what === "camera" ? this.startCamera() : this.start()) },
      };
    }
    if (name === "NotFoundError" || name === "DevicesNotFoundError" || name === "OverconstrainedError") {
      return {
        title: `No ${device} found`,
        text: `Connect a ${device}, or pick another one in Settings, then try again.`,
        action: { label: "Try again", fn: () => (what === "camera" ? this.startCamera() : this.start()) },
      };
    }
    if (name === "NotReadableError" || name === "AbortError" || name === "TrackStartError") {
      return {
        title: `The ${device} is busy`,
        text: `Another app is using the ${device}. Close it, then try again.`,
        action: { label: "Try again", fn: () => (what === "camera" ? this.startCamera() : this.start()) },
      };
    }
    return { title: `The ${device} could not start`, text: `${name} ${err?.message || ""}`.trim() };
  }

  onRemoteStream(stream) {
    const audio = $("remote-audio");
    audio.srcObject = stream; // Chrome only feeds remote WebRTC audio to WebAudio when an element plays it
    audio.play().catch(() => {
      this.showAlert({ title: "Sound is blocked", text: "Tap anywhere to hear the agent.", kind: "info" });
      document.addEventListener("pointerdown", () => { audio.play().catch(() => {}); this.hideAlert(); },
        { once: true });
    });
    this.agentMeter?.stop();
    this.meters.attach(stream, AGENT_THRESHOLD).then((m) => { this.agentMeter = m; });
  }

  // ---- server events ----------------------------------------------------------------------------------
  onEvent(msg) {
    this.events.push(msg.type);
    if (this.events.length > 500) this.events.splice(0, 100);
    switch (msg.type) {
      case "session.created":
      case "session.updated":
        this.sessionInfo = msg.session ?? null;
        if (Array.isArray(msg.session?.output_modalities)) this.setTextMode(msg.session.output_modalities[0] === "text");
        if (msg.type === "session.updated" && msg.session) this.toolsUpdated(msg.session);
        if (msg.session?.input_audio_transcription === null) this.dropProvisional(); // off: none will complete
        break;
      case "conversation.state":
        if (msg.state === "thinking" && this.state !== "speaking") this.setState("thinking");
        else if (msg.state === "speaking") this.setState("speaking");
        else if (msg.state === "listening" && ["thinking", "speaking"].includes(this.state)) {
          this.setState(this.currentUser ? "hearing" : "listening");
        }
        break;
      case "input_audio_buffer.speech_started":
        this.userStarted(msg.item_id);
        break;
      case "input_audio_buffer.speech_stopped":
        this.userStopped(msg.item_id);
        break;
      case "input_audio_buffer.committed":
        this.userCommitted(msg.item_id);
        break;
      case "input_audio_buffer.cleared":
        this.userCleared();
        break;
      case "conversation.item.input_audio_transcription.delta":
        this.captionPart(msg, false, msg.delta);
        break;
      case "conversation.item.input_audio_transcription.completed":
        this.captionPart(msg, true, msg.transcript);
        break;
      case "conversation.item.input_audio_transcription.failed": // that part has no words
        this.captionPart(msg, true, "");
        break;
      case "response.created":
        this.responseCreated(msg.response?.id ?? `resp_${this.responses.size + 1}`);
        break;
      case "response.output_audio_transcript.delta":
      case "response.audio_transcript.delta":
      case "response.output_text.delta": // text mode: the answer is written, not spoken
        this.transcriptDelta(msg.response_id, msg.delta ?? "");
        break;
      case "response.function_call_arguments.delta":
        this.callArguments(msg, false);
        break;
      case "response.function_call_arguments.done":
        this.callArguments(msg, true);
        break;
      case "response.done":
        this.responseDone(msg.response ?? {});
        break;
      case "error":
        // The server's complaints about tools name them ("tools[1] (name): …", "tool_choice …").
        if (/^tool/.test(msg.error?.message ?? "")) this.toolsRefused(msg.error.message);
        else this.serverError(msg.error ?? {});
        break;
      default:
        break;
    }
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
    if (this.state === "listening") this.setState("hearing");
  }

  userStopped(id) {
    if (!this.currentUser) this.userStarted(id);
    const u = this.currentUser;
    this.currentUser = null;
    const lastLoud = this.micMeter?.lastLoud;
    const end = lastLoud && performance.now() - lastLoud < 5000 ? lastLoud : performance.now();
    Object.assign(u, { live: false, spokeS: Math.max(0.1, (end - u.startedAt) / 1000) });
    this.renderUser(u);
    this.armLatency(end);
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
    if (this.state === "hearing") this.setState("listening");
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
    if (u.live) return this.settings.ptt ? "Talking… release to send" : "Speaking…";
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

  /** Starts timing the first heard answer audio from `ref` (perf ms: when the caller stopped talking). */
  armLatency(ref) {
    const pending = (this.pending = { ref, heardMs: null, responseId: null });
    const onset = (at) => {
      if (this.pending !== pending) return;
      pending.heardMs = Math.max(0, at - ref);
      this.showHeard(pending);
      if (["thinking", "listening"].includes(this.state)) this.setState("speaking");
    };
    if (this.agentMeter && this.meters.running) this.agentMeter.arm(onset);
    else this.pollOnset(pending, onset);
  }

  /** Without a running AudioContext (autoplay rules): watch the receiver's audio energy instead. */
  async pollOnset(pending, onset) {
    const call = this.call;
    let last = null;
    while (this.pending === pending && call === this.call && call) {
      const s = await call.inboundAudio();
      const energy = s?.totalAudioEnergy ?? 0;
      const dur = s?.totalSamplesDuration ?? 0;
      if (last && dur > last.dur) {
        const rms = Math.sqrt((energy - last.energy) / (dur - last.dur));
        if (rms > AGENT_THRESHOLD) return onset(performance.now());
      }
      last = { energy, dur };
      await new Promise((r) => setTimeout(r, 40));
    }
  }

  responseCreated(id) {
    if (this.currentUser) this.userStopped(); // push-to-talk commits may come without speech_stopped
    if (!this.pending || this.pending.responseId) this.armLatency(this.pttReleasedAt ?? performance.now());
    this.pending.responseId = id;
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
    if (this.state !== "speaking") this.setState("thinking");
    if (this.pending.heardMs != null) this.showHeard(this.pending);
  }

  transcriptDelta(id, delta) {
    const r = (id && this.responses.get(id)) || this.current;
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
    const r = (resp.id && this.responses.get(resp.id)) || this.current;
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
    for (const call of r.calls) if (!call.done) this.callCut(call);
    r.li.classList.remove("live");
    r.li.removeAttribute("aria-busy");
    r.li.classList.toggle("cut", r.interrupted);
    if (r.interrupted) {
      const tag = document.createElement("span");
      tag.className = "cut-tag";
      tag.textContent = "interrupted";
      text.after(tag);
      r.li.setAttribute("aria-label", `Agent (interrupted): ${r.text}`);
    }
    if (r.failed) r.li.classList.add("failed");
    if (this.pending?.responseId === r.id) r.heard_ms = this.pending.heardMs;
    this.renderMeta(r);
    this.turns.push({ id: r.id, text: r.text, interrupted: r.interrupted, ttfp_ms: r.ttfp_ms, heard_ms: r.heard_ms,
      frames: m.frames ?? null, audio_s: m.audio_s ?? null });
    this.showLatency(r);
    this.continueAfterCalls(r);
    if (this.current === r) this.current = null;
    if (["thinking", "speaking"].includes(this.state)) {
      // The last packets still play for a moment after the server is done with them.
      setTimeout(() => {
        if (["thinking", "speaking"].includes(this.state) && !this.current) {
          this.setState(this.currentUser ? "hearing" : "listening");
        }
      }, r.interrupted ? 0 : 250);
    }
  }

  showHeard(pending) {
    const r = pending.responseId && this.responses.get(pending.responseId);
    if (!r) return;
    r.heard_ms = pending.heardMs;
    const turn = this.turns.find((t) => t.id === r.id); // the audio may be heard after response.done
    if (turn) turn.heard_ms = r.heard_ms;
    this.renderMeta(r);
    this.showLatency(r);
  }

  renderMeta(r) {
    let meta = r.li.querySelector(".meta");
    if (!meta) {
      meta = document.createElement("p");
      meta.className = "meta";
      r.li.append(meta);
    }
    const parts = [];
    if (r.heard_ms != null) parts.push(`heard after ${fmtMs(r.heard_ms)}`);
    if (r.ttfp_ms != null) parts.push(`server first packet ${fmtMs(r.ttfp_ms)}`);
    else if (this.textMode && r.ttft_ms != null) parts.push(`first text ${fmtMs(r.ttft_ms)}`);
    meta.textContent = parts.join(" · ");
    meta.hidden = !parts.length;
  }

  showLatency(r) {
    $("latency").hidden = false;
    $("lat-heard").textContent = r.heard_ms != null ? fmtMs(r.heard_ms) : "–";
    $("lat-server").textContent = r.ttfp_ms != null ? fmtMs(r.ttfp_ms) : r.done ? "–" : "…";
    $("lat-text-item").hidden = !this.textMode || r.ttft_ms == null;
    $("lat-text").textContent = r.ttft_ms != null ? fmtMs(r.ttft_ms) : "–";
  }

  // ---- function calls ------------------------------------------------------------------------------
  /** A function call's arguments as they stream (`done`: whole, with its result box). */
  callArguments(msg, done) {
    const call = this.calls.get(msg.call_id) ?? this.newCall(msg);
    if (!call || call.done) return;
    call.args = done ? msg.arguments ?? call.args : call.args + (msg.delta ?? "");
    call.argsEl.textContent = call.args;
    if (done) {
      call.done = true;
      this.setCallStatus(call, "done", "done");
      call.card.append(this.resultForm(call));
    }
    this.scrollLog();
  }

  newCall(msg) {
    const r = (msg.response_id && this.responses.get(msg.response_id)) || this.current;
    if (!r || !msg.call_id) return null;
    const card = el("div", "call");
    card.setAttribute("role", "group");
    card.setAttribute("aria-label", `Function call ${msg.name}`);
    card.dataset.callId = msg.call_id;
    const head = el("p", "call-head", "");
    const status = el("span", "call-status", "calling…");
    head.append(el("span", "call-tag", "Function call"), el("code", "call-name", msg.name ?? ""), status);
    const argsEl = el("pre", "call-args", "");
    card.append(head, argsEl);
    r.li.insertBefore(card, r.li.querySelector(".meta")); // (null: at the end)
    if (!r.text) r.li.querySelector(".text").hidden = true;
    const call = { id: msg.call_id, name: msg.name ?? "", args: "", done: false, cut: false, sent: false,
      responseId: r.id, card, argsEl, status };
    r.calls.push(call);
    this.calls.set(call.id, call);
    return call;
  }

  setCallStatus(call, text, kind) {
    call.status.textContent = text;
    call.card.dataset.status = kind;
  }

  /** The answer ended (barge-in, cancel, length limit) while this call was being written: it is not kept. */
  callCut(call) {
    call.cut = true;
    this.setCallStatus(call, "cut off: not kept", "cut");
  }

  /** The box a developer answers a whole call with: the function's result, then the answer goes on. */
  resultForm(call) {
    const form = el("form", "call-result");
    const boxId = `result-${call.id}`;
    const label = el("label", "", `Result of ${call.name}`);
    label.htmlFor = boxId;
    const box = el("textarea", "code");
    Object.assign(box, { id: boxId, name: "output", rows: 2, maxLength: 8000, spellcheck: false, value: TOOL_RESULT });
    const send = el("button", "btn", "Send result");
    send.type = "submit";
    form.append(label, box);
    if (this.forcedToolChoice()) {
      const auto = el("label", "check");
      const tick = el("input");
      Object.assign(tick, { type: "checkbox", name: "auto", checked: true });
      auto.append(tick, el("span", "", "Then let the agent answer in words (tool choice auto)"));
      form.append(auto);
    }
    form.append(send);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.sendResult(call, form);
    });
    return form;
  }

  /** tool_choice "required" or a named function: the next answer would be a call again. */
  forcedToolChoice() {
    const choice = this.sessionInfo?.tool_choice;
    return choice === "required" || (typeof choice === "object" && !!choice);
  }

  sendResult(call, form) {
    if (!this.call || call.sent || call.ended) return;
    if (form.elements.auto?.checked && this.forcedToolChoice()) this.switchToolChoiceToAuto();
    const output = form.elements.output.value;
    this.call.send({ type: "conversation.item.create", item: { type: "function_call_output", call_id: call.id,
      output } });
    call.sent = true;
    for (const c of form.elements) c.disabled = true;
    this.setCallStatus(call, "result sent", "sent");
    this.continueAfterCalls(this.responses.get(call.responseId));
  }

  /** response.create once the answer is over and each of its whole calls has its result. */
  continueAfterCalls(r) {
    if (!r?.done || r.continued || !this.call) return;
    const whole = r.calls.filter((c) => c.done);
    if (!whole.length || whole.some((c) => !c.sent)) return;
    r.continued = true;
    this.armLatency(performance.now()); // the next answer is heard after this
    this.call.send({ type: "response.create" });
  }

  /** The call is over: its function calls can no longer take results. */
  closeCalls() {
    for (const call of this.calls.values()) {
      if (!call.done || call.sent || call.ended) continue;
      call.ended = true;
      for (const c of call.card.querySelector("form").elements) c.disabled = true;
      this.setCallStatus(call, "call ended", "ended");
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
      this.showAlert({ title: "Nothing heard", text: "Hold the talk button while you speak, then let go.", kind: "info",
        autoHide: 4000 });
    } else if (code === "media_process_failed") { // a resumed call, moved to another server process: kept in the log
      this.addNote(err.message || "The server process of this call stopped; the call goes on in another.");
    } else if (code === "conversation_already_has_active_response") {
      this.showAlert({ title: "The agent is still answering", text: "Wait for the answer, or talk over it.",
        kind: "info", autoHide: 4000 });
    } else {
      this.showAlert({ title: "The agent reported a problem", text: err.message || code, kind: "info", autoHide: 8000 });
    }
  }

  endAnswerState() {
    this.pending = null;
    if (this.currentUser) {
      this.currentUser.live = false;
      this.renderUser(this.currentUser);
      this.currentUser = null;
    }
    this.dropProvisional(); // the connection is gone: no more words come for them
    for (const r of this.responses.values()) {
      if (!r.done) {
        r.done = true;
        r.li.classList.remove("live");
        r.li.removeAttribute("aria-busy");
      }
    }
    this.current = null;
  }

  // ---- push-to-talk -----------------------------------------------------------------------------------
  bindPushToTalk() {
    const b = $("ptt-btn");
    b.addEventListener("pointerdown", (e) => {
      if (e.button !== 0) return;
      b.setPointerCapture?.(e.pointerId);
      this.pttDown();
    });
    for (const ev of ["pointerup", "pointercancel", "lostpointercapture"]) b.addEventListener(ev, () => this.pttUp());
    b.addEventListener("contextmenu", (e) => e.preventDefault());
    b.addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.repeat) this.pttDown(); });
    b.addEventListener("keyup", (e) => { if (e.key === "Enter") this.pttUp(); });
  }

  pttDown() {
    if (!this.settings.ptt || !this.call || this.pttHeld) return;
    this.pttHeld = true;
    this.pttReleasedAt = null;
    $("ptt-btn").classList.add("held");
    $("ptt-btn").querySelector(".ctl-label").textContent = "Release to send";
    if (this.current && !this.current.done) this.call.send({ type: "response.cancel" });
    this.applyTrackEnabled();
    if (["listening", "speaking", "thinking"].includes(this.state)) this.setState("hearing");
    $("state-hint").textContent = "Talking… release to send.";
  }

  pttUp() {
    if (!this.pttHeld) return;
    this.pttHeld = false;
    this.pttReleasedAt = performance.now();
    $("ptt-btn").classList.remove("held");
    $("ptt-btn").querySelector(".ctl-label").textContent = "Hold to talk";
    const call = this.call;
    setTimeout(() => {
      if (call && call === this.call) call.send({ type: "input_audio_buffer.commit" });
      this.applyTrackEnabled();
      if (this.state === "hearing" && !this.currentUser) this.setState("listening");
    }, PTT_TAIL_MS);
  }

  onKey(e, down) {
    const t = e.target;
    const typing = t instanceof HTMLElement && (t.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(t.tagName));
    if (typing || $("settings").open || e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.code === "Space" && this.settings.ptt && this.call) {
      e.preventDefault(); // no scrolling, no click on the focused button
      if (down && !e.repeat) this.pttDown();
      else if (!down) this.pttUp();
    } else if (down && !e.repeat && (e.key === "m" || e.key === "M") && this.inCall) {
      this.setMuted(!this.muted);
    }
  }

  // ---- settings dialog --------------------------------------------------------------------------------
  openSettings() {
    this.applySettingsToUi();
    this.listDevices();
    this.renderStats();
    const d = $("settings");
    if (!d.open) d.showModal();
  }

  async closeSettings() {
    const d = $("settings");
    if (d.returnValue !== "apply") return;
    d.returnValue = "";
    const s = this.settings;
    const before = { ...s };
    s.voice = $("voice").value;
    s.instructions = $("instructions").value;
    s.processing = $("processing").checked;
    s.ptt = $("ptt").checked;
    if (!$("captions").disabled) s.captions = $("captions").checked;
    s.turn = $("turn").value;
    s.micId = $("mic-select").value;
    s.camId = $("cam-select").value;
    s.tools = $("tools").value;
    s.toolChoice = $("tool-choice").value;
    const mode = document.querySelector('input[name="mode"]:checked')?.value || this.mode;
    s.mode = mode;
    saveSettings(s);
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
    if (s.tools !== before.tools || s.toolChoice !== before.toolChoice || this.toolsError) {
      this.sendTools(this.toolsUpdate());
    }
    this.applySettingsToUi();
    if (this.call) {
      const update = {};
      if (s.voice !== before.voice && s.voice) update.voice = s.voice;
      if (s.instructions !== before.instructions) update.instructions = s.instructions;
      if (s.ptt !== before.ptt || s.turn !== before.turn) update.turn_detection = await this.turnDetection();
      if (s.captions !== before.captions) update.input_audio_transcription = await this.transcription();
      if (Object.keys(update).length) {
        this.call.updateSession(update);
        this.addNote(describeUpdate(update));
      }
    }
    if (this.micTrack && (s.processing !== before.processing || s.micId !== before.micId)) {
      try {
        await this.useMic(await this.openMic());
      } catch (err) {
        this.showAlert(this.mediaError(err, "microphone"));
      }
    }
    this.applyTrackEnabled();
    if (this.camOn && s.camId !== before.camId) await this.startCamera();
  }

  // ---- tools -------------------------------------------------------------------------------------------
  /** The tools box was edited: the tool choice offers its functions once the JSON parses. */
  onToolsInput() {
    const { tools } = parseTools($("tools").value);
    if (!tools) return;
    this.fillToolChoice(toolNames(tools), $("tool-choice").value);
    this.showToolsError("");
  }

  fillToolChoice(names, value) {
    const select = $("tool-choice");
    for (const o of [...select.options]) if (o.value.startsWith("function:")) o.remove();
    select.append(...names.map((n) => new Option(`${n}: every answer calls it`, `function:${n}`)));
    select.value = [...select.options].some((o) => o.value === value) ? value : "auto";
  }

  showToolsError(text) {
    $("tools-error").textContent = text;
    $("tools-error").hidden = !text;
    $("tools").toggleAttribute("aria-invalid", !!text);
  }

  /** Apply: the tools box must parse (else its error shows, with the focus on it, and nothing changes). */
  checkTools() {
    const { tools, error } = parseTools($("tools").value);
    const choice = $("tool-choice").value;
    const problem = error ?? (choice === "required" && !tools.length ? 'Tool choice "required" needs a tool.' : "");
    this.showToolsError(problem);
    if (problem) $("tools").focus();
    return !problem;
  }

  /** session.update's tools and tool_choice for the saved settings. */
  toolsUpdate() {
    return { tools: parseTools(this.settings.tools).tools ?? [], tool_choice: toolChoice(this.settings.toolChoice) };
  }

  /** Sends a tools update; session.updated or the server's error about it settles it (see onEvent). */
  sendTools(update) {
    this.toolsError = "";
    this.showToolsError("");
    if (this.call?.updateSession(update)) this.toolsSent = update;
  }

  toolsUpdated(session) {
    const sent = this.toolsSent;
    const names = (list) => JSON.stringify(list.map((t) => t?.name));
    if (!sent || JSON.stringify(session.tool_choice) !== JSON.stringify(sent.tool_choice)) return;
    if (sent.tools && names(session.tools ?? []) !== names(sent.tools)) return;
    this.toolsSent = null;
    const list = (session.tools ?? []).map((t) => t.name).join(", ") || "none";
    this.addNote(`Tools: ${list} · tool choice ${choiceText(session.tool_choice)}`);
  }

  toolsRefused(message) {
    this.toolsSent = null;
    this.toolsError = `The server refused the tools: ${message}. The call goes on with the tools it had.`;
    this.showToolsError(this.toolsError);
    this.addNote("Tools not accepted");
    this.showAlert({ title: "The tools were not accepted", text: message,
      action: { label: "Settings", fn: () => this.openSettings() } });
  }

  /** A call's "answer in words next": tool_choice auto, in the settings and on the server. */
  switchToolChoiceToAuto() {
    this.settings.toolChoice = "auto";
    saveSettings(this.settings);
    $("tool-choice").value = "auto";
    this.sendTools({ tool_choice: "auto" });
  }

  /** session.update's turn_detection for the settings: null (push-to-talk), the chosen kind, or the server's. */
  async turnDetection() {
    const s = this.settings;
    if (s.ptt) return null;
    if (!s.turn) return (await this.config)?.turn_detection ?? { type: "semantic_vad" };
    const [type, eagerness] = s.turn.split(":");
    return eagerness ? { type, eagerness } : { type };
  }

  /** session.update's input_audio_transcription for the settings: the server's recogniser, or null (off). */
  async transcription() {
    if (!this.settings.captions) return null;
    const model = (await this.config)?.input_audio_transcription?.model;
    return model ? { model } : {};
  }

  // ---- stats, wake lock ---------------------------------------------------------------------------------
  startStats() {
    this.stopStats();
    this._statsTimer = setInterval(() => this.renderStats(), 1000);
    const tick = () => {
      this._raf = requestAnimationFrame(tick);
      const speaking = this.state === "speaking";
      const level = speaking ? this.agentMeter?.level ?? 0 : (this.micTrack?.enabled ? this.micMeter?.level ?? 0 : 0);
      const v = Math.min(1, Math.sqrt(level) * 3);
      const orb = $("orb");
      const prev = Number(orb.dataset.level || 0);
      const next = v > prev ? v : prev * 0.85 + v * 0.15;
      orb.dataset.level = String(next);
      orb.style.setProperty("--level", next.toFixed(3));
    };
    tick();
  }

  stopStats() {
    clearInterval(this._statsTimer);
    cancelAnimationFrame(this._raf);
    $("orb").style.setProperty("--level", "0");
  }

  async renderStats() {
    const el = $("stats");
    const s = await this.call?.stats();
    if (!s) {
      el.textContent = "";
      return;
    }
    const prev = this._prevStats;
    const now = performance.now();
    const rate = (a, b, key) => (a && b && a[key] != null && b[key] != null ? ((a[key] - b[key]) * 1000) / (now - prev.at) : null);
    const parts = [];
    if (s.rttMs != null) parts.push(`round trip ${Math.round(s.rttMs)} ms`);
    const pps = prev && rate(s.audioIn, prev.audioIn, "packetsReceived");
    if (pps != null) parts.push(`agent audio ${pps.toFixed(1)} packets/s`);
    if (s.videoOut?.framesSent) {
      const fps = prev && rate(s.videoOut, prev.videoOut, "framesSent");
      parts.push(`video out ${fps != null ? fps.toFixed(1) : "–"} fps, ${s.videoOut.frameWidth ?? "?"}×${s.videoOut.frameHeight ?? "?"}`);
    }
    this._prevStats = { ...s, at: now };
    el.textContent = parts.length ? `Connection: ${parts.join(" · ")}` : "";
  }

  async keepAwake() {
    if (this.mode === "call" || !("wakeLock" in navigator) || document.visibilityState !== "visible") return;
    if (this.wakeLock && !this.wakeLock.released) return;
    try { this.wakeLock = await navigator.wakeLock.request("screen"); } catch { /* battery saver, no support */ }
  }

  releaseWake() {
    this.wakeLock?.release().catch(() => {});
    this.wakeLock = null;
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
    this.renderVideoButtons();
  }

  addItem(role, who) {
    const li = document.createElement("li");
    li.className = `turn ${role}`;
    const name = document.createElement("span");
    name.className = "who";
    name.textContent = who;
    const text = document.createElement("p");
    text.className = "text";
    li.append(name, text);
    $("log").append(li);
    $("log-empty").hidden = true;
    this.scrollLog(true);
    return li;
  }

  addNote(text) {
    const li = document.createElement("li");
    li.className = "note";
    li.textContent = text;
    $("log").append(li);
    $("log-empty").hidden = true;
    this.scrollLog(true);
  }

  scrollLog(force = false) {
    const log = $("log");
    const scroller = log.closest(".transcript");
    const near = scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 120;
    if (force || near) scroller.scrollTop = scroller.scrollHeight;
  }

  showAlert({ title, text = "", action = null, token = false, kind = "error", autoHide = 0 }) {
    clearTimeout(this._alertTimer);
    const a = $("alert");
    a.dataset.kind = kind;
    $("alert-title").textContent = title;
    $("alert-text").textContent = text.replace(/\s+/g, " ");
    const btn = $("alert-action");
    btn.hidden = !action;
    btn.onclick = action ? () => { this.hideAlert(); action.fn(); } : null;
    if (action) btn.textContent = action.label;
    $("token-form").hidden = !token;
    a.hidden = false;
    if (token) $("token-input").focus();
    if (autoHide) this._alertTimer = setTimeout(() => this.hideAlert(), autoHide);
  }

  hideAlert() {
    clearTimeout(this._alertTimer);
    $("alert").hidden = true;
  }
}

/** An element with a class and text. */
function el(tag, className = "", text = "") {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text) e.textContent = text;
  return e;
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

function tail(text, n) {
  if (text.length <= n) return text.trim();
  const cut = text.slice(-n);
  return `…${cut.slice(cut.indexOf(" ") + 1)}`;
}

function fmtMs(ms) {
  return ms >= 10000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

function describeUpdate(u) {
  const parts = [];
  if (u.voice) parts.push(`voice ${u.voice}`);
  if ("instructions" in u) parts.push("instructions");
  const turn = u.turn_detection;
  if ("turn_detection" in u) {
    parts.push(!turn ? "push-to-talk" : turn.type === "semantic_vad" ? `smart turns (${turn.eagerness ?? "auto"})`
      : "fixed-silence turns");
  }
  if ("input_audio_transcription" in u) parts.push(u.input_audio_transcription ? "captions on" : "captions off");
  return `Updated: ${parts.join(", ")}`;
}

const app = new App();
window.rtcAgent = app; // for the console and the browser tests
app.init();
