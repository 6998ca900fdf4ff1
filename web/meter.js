// Audio levels of the caller's microphone and the agent's voice, measured in an AudioWorklet (meter-worklet.js).
// Used for the level animation, the caller's end of speech, and the first heard answer audio.

export class Meters {
  constructor() {
    this.ctx = null;
    this._loading = null;
  }

  /** Creates the AudioContext (suspended until a user gesture in some browsers) and loads the worklet. */
  init() {
    if (!this._loading) {
      this._loading = (async () => {
        const Ctx = window.AudioContext || window.webkitAudioContext;
        if (!Ctx) return null;
        const ctx = new Ctx({ latencyHint: "interactive" });
        await ctx.audioWorklet.addModule(new URL("meter-worklet.js", import.meta.url));
        this.ctx = ctx;
        this.resume();
        return ctx;
      })().catch(() => null);
    }
    return this._loading;
  }

  resume() {
    if (this.ctx && this.ctx.state === "suspended") this.ctx.resume().catch(() => {});
  }

  get running() {
    return this.ctx?.state === "running";
  }

  /** AudioContext time (s) -> performance.now() time (ms) of when that sample is heard. */
  toPerf(t) {
    const ts = this.ctx.getOutputTimestamp?.();
    if (ts && ts.performanceTime) return ts.performanceTime + (t - ts.contextTime) * 1000;
    return performance.now() - (this.ctx.currentTime - t) * 1000;
  }

  /** Measures `stream`. Returns a handle: level (RMS), lastLoud (perf ms), arm(cb) for the next onset, stop(). */
  async attach(stream, threshold) {
    const ctx = await this.init();
    if (!ctx || !stream.getAudioTracks().length) return null;
    const source = ctx.createMediaStreamSource(stream);
    const node = new AudioWorkletNode(ctx, "level-meter", { numberOfOutputs: 1, outputChannelCount: [1] });
    const sink = ctx.createGain();
    sink.gain.value = 0; // keeps the node pulled by the graph without playing anything
    source.connect(node).connect(sink).connect(ctx.destination);
    node.port.postMessage({ threshold });
    const handle = {
      level: 0,
      lastLoud: null,
      _onset: null,
      arm(cb) {
        handle._onset = cb;
        node.port.postMessage({ armed: true });
      },
      disarm() {
        handle._onset = null;
        node.port.postMessage({ armed: false });
      },
      stop() {
        try { source.disconnect(); node.disconnect(); sink.disconnect(); } catch { /* gone */ }
        node.port.onmessage = null;
      },
    };
    node.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === "level") {
        handle.level = m.rms;
        if (m.lastLoud >= 0) handle.lastLoud = this.toPerf(m.lastLoud);
      } else if (m.type === "onset" && handle._onset) {
        const cb = handle._onset;
        handle._onset = null;
        cb(this.toPerf(m.time), m.rms);
      }
    };
    return handle;
  }
}
