// One WebRTC call to the rtc-agent server: signaling (POST api/offer, DELETE api/sessions/{id}), the `events`
// data channel, the outgoing low-rate video, and liveness. Knows nothing about the page's markup.

// What the server gives the model (GET api/config "video" overrides it): frames per second, longest side.
const VIDEO_DEFAULTS = { fps: 2, max_side: 384 };
// Video goes out at the server's rate but with some more pixels than it keeps, so that the codec's artifacts
// shrink away when the server scales the frame down.
const VIDEO_SEND_MIN_SIDE = 640;
const VIDEO_BITRATE_AT_MIN_SIDE = 250_000;
const ICE_GATHER_TIMEOUT_MS = 2500;
const CONNECT_TIMEOUT_MS = 15000;
const RESUME_CONNECT_TIMEOUT_MS = 5000; // a resume tries again soon rather than wait long on a dead network
const SILENT_PEER_MS = 4000; // the server sends a packet every 80 ms, silence included

/** An HTTP error from the server's JSON error body: {"error": {"code", "message"}}. */
export class ServerError extends Error {
  constructor(status, code, message, retryAfter) {
    super(message || `HTTP ${status}`);
    this.name = "ServerError";
    this.status = status;
    this.code = code || "";
    this.retryAfter = retryAfter;
  }
}

/** The network or the peer connection failed. */
export class ConnectionError extends Error {
  constructor(message) {
    super(message);
    this.name = "ConnectionError";
  }
}

export function apiUrl(path) {
  return new URL(path, document.baseURI).toString();
}

function authHeaders(token) {
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function errorFrom(resp) {
  let code = "", message = "";
  try {
    const body = await resp.json();
    code = body?.error?.code ?? "";
    message = body?.error?.message ?? "";
  } catch { /* not JSON */ }
  const retry = Number.parseFloat(resp.headers.get("Retry-After") ?? "");
  return new ServerError(resp.status, code, message, Number.isFinite(retry) ? retry : undefined);
}

function waitIceGathering(pc, timeoutMs) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => { if (pc.iceGatheringState === "complete") done(); };
    const timer = setTimeout(done, timeoutMs); // STUN may hang; send what was gathered
    pc.addEventListener("icegatheringstatechange", check);
  });
}

/**
 * Events (CustomEvent, detail in brackets):
 *   message [server JSON]   state ["connecting"|"connected"|"lost"|"closed"]   remotestream [MediaStream]
 */
export class Call extends EventTarget {
  constructor({ token = "", voice, instructions, micTrack, micStream, video = false, videoLimits = VIDEO_DEFAULTS,
                iceServers = [], transcription }) {
    super();
    this.token = token;
    this.voice = voice;
    this.instructions = instructions;
    this.micTrack = micTrack;
    this.micStream = micStream;
    this.wantsVideo = video;
    this.videoLimits = videoLimits;
    this.iceServers = iceServers;
    this.transcription = transcription; // the offer's input_audio_transcription: null (off); undefined: the server's
    this.sessionId = null;
    this.resumeToken = null; // from session.created: a new peer connection may take over this call
    this.resumeWindowS = 0; // how long the server keeps the call for that once the connection died
    this.pc = null;
    this.dc = null;
    this.remoteStream = null;
    this.audioSender = null;
    this.videoSender = null;
    this.closed = false;
    this._lastPackets = -1;
    this._lastPacketAt = 0;
    this._watch = null;
    this._disconnectTimer = null;
    this._opening = false;
  }

  _emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** A new call. */
  start() {
    const body = {};
    if (this.voice) body.voice = this.voice;
    if (this.instructions) body.instructions = this.instructions;
    if (this.transcription !== undefined) body.input_audio_transcription = this.transcription;
    return this._open(body, CONNECT_TIMEOUT_MS);
  }

  /**
   * The same call over a new peer connection, after the old one died: the server keeps the conversation (same
   * session, same history) for resumeWindowS. Rejects with ServerError 404 once the server has ended the call.
   */
  async resume() {
    if (!this.resumeToken) throw new ConnectionError("This call cannot be resumed.");
    this._dropConnection();
    this._lostReported = false;
    return this._open({ resume_token: this.resumeToken }, RESUME_CONNECT_TIMEOUT_MS);
  }

  _onMessage(msg) {
    if (msg.type === "session.created") {
      this.resumeToken = msg.session?.resume?.token ?? null;
      this.resumeWindowS = msg.session?.resume?.window_s ?? 0;
    } else if (msg.type === "error" && ["idle_timeout", "session_expired"].includes(msg.error?.code)) {
      this.resumeToken = null; // the server is ending the call on purpose: nothing to come back to
    }
    this._emit("message", msg);
  }

  async _open(extra, connectTimeoutMs) {
    this._opening = true; // until connected: a failure here is this promise's, not a "lost" state
    try {
      return await this._connect(extra, connectTimeoutMs);
    } catch (err) {
      this._dropConnection(); // a failed attempt's peer connection must not report "lost" later
      throw err;
    } finally {
      this._opening = false;
    }
  }

  async _connect(extra, connectTimeoutMs) {
    const pc = (this.pc = new RTCPeerConnection({ iceServers: this.iceServers, bundlePolicy: "max-bundle" }));
    const dc = (this.dc = pc.createDataChannel("events", { ordered: true }));
    const current = () => pc === this.pc; // events of a peer connection a resume replaced do not count
    dc.addEventListener("message", (e) => {
      let msg;
      try { msg = JSON.parse(e.data); } catch { return; }
      if (current() && msg && typeof msg.type === "string") this._onMessage(msg);
    });
    dc.addEventListener("close", () => current() && this._lost("The server ended the call or went away."));

    const audio = pc.addTransceiver(this.micTrack, { direction: "sendrecv", streams: [this.micStream] });
    this.audioSender = audio.sender;
    if (this.wantsVideo) {
      // A video line from the start, so that the camera and screen share come and go without renegotiation.
      const video = pc.addTransceiver("video", { direction: "sendonly" });
      this.videoSender = video.sender;
    }
    pc.addEventListener("track", (e) => {
      if (e.track.kind !== "audio" || !current()) return;
      this.remoteStream = e.streams[0] ?? new MediaStream([e.track]);
      this._emit("remotestream", this.remoteStream);
    });
    pc.addEventListener("connectionstatechange", () => current() && this._onConnectionState());

    await pc.setLocalDescription(await pc.createOffer());
    await waitIceGathering(pc, ICE_GATHER_TIMEOUT_MS);
    if (this.closed) throw new ConnectionError("The call was ended.");

    const body = { sdp: pc.localDescription.sdp, type: "offer", ...extra };
    let resp;
    try {
      resp = await fetch(apiUrl("api/offer"), {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders(this.token) },
        body: JSON.stringify(body),
        cache: "no-store",
      });
    } catch {
      throw new ConnectionError("The server cannot be reached.");
    }
    if (!resp.ok) throw await errorFrom(resp);
    const answer = await resp.json();
    this.sessionId = answer.session_id ?? null;
    if (this.closed) { this._deleteSession(); throw new ConnectionError("The call was ended."); }
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
    await this._connected(connectTimeoutMs);
    this._startWatch();
    return this.sessionId;
  }

  _connected(timeoutMs) {
    const { pc, dc } = this;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => finish(new ConnectionError("The media connection did not come up.")), timeoutMs);
      const check = () => {
        if (this.closed) finish(new ConnectionError("The call was ended."));
        else if (pc.connectionState === "failed") finish(new ConnectionError("The media connection failed."));
        else if (dc.readyState === "open" && pc.connectionState === "connected") finish();
      };
      const finish = (err) => {
        clearTimeout(timer);
        pc.removeEventListener("connectionstatechange", check);
        dc.removeEventListener("open", check);
        err ? reject(err) : resolve();
      };
      pc.addEventListener("connectionstatechange", check);
      dc.addEventListener("open", check);
      check();
    });
  }

  _onConnectionState() {
    const state = this.pc?.connectionState;
    clearTimeout(this._disconnectTimer);
    if (state === "failed") this._lost("The network connection failed.");
    else if (state === "disconnected") {
      this._disconnectTimer = setTimeout(() => this._lost("The network connection dropped."), SILENT_PEER_MS);
    }
  }

  /** The server sends audio all the time (silence between answers): no packets for a while means it is gone. */
  _startWatch() {
    this._lastPackets = -1;
    this._lastPacketAt = performance.now();
    this._watch = setInterval(async () => {
      const s = await this.inboundAudio();
      if (this.closed || !s) return;
      if (s.packetsReceived !== this._lastPackets) {
        this._lastPackets = s.packetsReceived;
        this._lastPacketAt = performance.now();
      } else if (performance.now() - this._lastPacketAt > SILENT_PEER_MS) {
        this._lost("Nothing has arrived from the server for a few seconds.");
      }
    }, 1000);
  }

  _lost(reason) {
    if (this.closed || this._lostReported || this._opening) return; // start() and resume() report their own
    this._lostReported = true;
    this._emit("state", { state: "lost", reason });
  }

  send(message) {
    if (this.dc?.readyState !== "open") return false;
    this.dc.send(JSON.stringify(message));
    return true;
  }

  updateSession(session) {
    return this.send({ type: "session.update", session });
  }

  async replaceMicTrack(track, stream) {
    this.micTrack = track;
    this.micStream = stream;
    if (this.audioSender) await this.audioSender.replaceTrack(track);
  }

  /** Sends `track` (camera or screen; null stops video) at the server's frame rate, scaled down. */
  async setVideoTrack(track) {
    if (!this.videoSender) return false;
    await this.videoSender.replaceTrack(track);
    if (track) await this._limitVideo(track);
    return true;
  }

  async _limitVideo(track) {
    const side = Math.max(VIDEO_SEND_MIN_SIDE, this.videoLimits.max_side);
    const { width = side, height = side } = track.getSettings();
    const params = this.videoSender.getParameters();
    if (!params.encodings?.length) params.encodings = [{}];
    Object.assign(params.encodings[0], {
      maxFramerate: this.videoLimits.fps,
      scaleResolutionDownBy: Math.max(1, Math.max(width, height) / side),
      maxBitrate: Math.round(VIDEO_BITRATE_AT_MIN_SIDE * (side / VIDEO_SEND_MIN_SIDE) ** 2),
    });
    params.degradationPreference = "maintain-resolution";
    try {
      await this.videoSender.setParameters(params);
    } catch {
      delete params.degradationPreference; // not settable in every browser
      await this.videoSender.setParameters(params);
    }
  }

  async stats() {
    if (!this.pc) return null;
    const report = await this.pc.getStats();
    const out = { audioIn: null, audioOut: null, videoOut: null, rttMs: null };
    report.forEach((s) => {
      if (s.type === "inbound-rtp" && s.kind === "audio") out.audioIn = s;
      else if (s.type === "outbound-rtp" && s.kind === "audio") out.audioOut = s;
      else if (s.type === "outbound-rtp" && s.kind === "video") out.videoOut = s;
      else if (s.type === "candidate-pair" && s.nominated && s.state === "succeeded" && s.currentRoundTripTime != null) {
        out.rttMs = s.currentRoundTripTime * 1000;
      }
    });
    return out;
  }

  async inboundAudio() {
    if (!this.pc) return null;
    const report = await this.pc.getStats();
    let found = null;
    report.forEach((s) => { if (s.type === "inbound-rtp" && s.kind === "audio") found = s; });
    return found;
  }

  /** Lets the peer connection go without ending the call on the server (a resume follows). */
  _dropConnection() {
    clearInterval(this._watch);
    clearTimeout(this._disconnectTimer);
    const { pc, dc } = this;
    this.pc = this.dc = this.remoteStream = this.audioSender = this.videoSender = null;
    try { dc?.close(); } catch { /* already closed */ }
    try { pc?.close(); } catch { /* already closed */ }
  }

  _deleteSession() {
    if (!this.sessionId) return Promise.resolve();
    const id = this.sessionId;
    this.sessionId = null;
    return fetch(apiUrl(`api/sessions/${encodeURIComponent(id)}`), {
      method: "DELETE",
      headers: authHeaders(this.token),
      keepalive: true,
    }).catch(() => {});
  }

  /** Ends the call here and on the server. Safe to call more than once. */
  async hangup() {
    if (this.closed) return;
    this.closed = true;
    clearInterval(this._watch);
    clearTimeout(this._disconnectTimer);
    const deleted = this._deleteSession();
    try { this.dc?.close(); } catch { /* already closed */ }
    try { this.pc?.close(); } catch { /* already closed */ }
    this._emit("state", { state: "closed" });
    await deleted;
  }
}
