// How long the caller waited: from the end of their speech to the first answer audio the page heard (the agent
// meter, or the receiver's audio energy without a running AudioContext), and the latency bar under the orb.
import { $, fmtMs } from "./dom.js";

export const AGENT_THRESHOLD = 0.0005; // first answer audio (about -66 dBFS RMS: decoded silence is far below)

/** The latency of the App `app`'s answers (its call, state, meters and transcript). */
export class Latency {
  constructor(app) {
    this.app = app;
    this.pending = null; // {ref: perf ms of the caller's end of speech, heardMs, responseId}
  }

  /** Starts timing the first heard answer audio from `ref` (perf ms: when the caller stopped talking). */
  arm(ref) {
    const app = this.app;
    const pending = (this.pending = { ref, heardMs: null, responseId: null });
    const onset = (at) => {
      if (this.pending !== pending) return;
      pending.heardMs = Math.max(0, at - ref);
      app.transcript.showHeard(pending);
      if (["thinking", "listening"].includes(app.state)) app.setState("speaking");
    };
    const { agentMeter, meters } = app.media;
    if (agentMeter && meters.running) agentMeter.arm(onset);
    else this.pollOnset(pending, onset);
  }

  /** Without a running AudioContext (autoplay rules): watch the receiver's audio energy instead. */
  async pollOnset(pending, onset) {
    const call = this.app.call;
    let last = null;
    while (this.pending === pending && call === this.app.call && call) {
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

  /** The latency bar for the answer `r`. */
  show(r) {
    const textMode = this.app.textMode;
    $("latency").hidden = false;
    $("lat-heard").textContent = r.heard_ms != null ? fmtMs(r.heard_ms) : "–";
    $("lat-server").textContent = r.ttfp_ms != null ? fmtMs(r.ttfp_ms) : r.done ? "–" : "…";
    $("lat-text-item").hidden = !textMode || r.ttft_ms == null;
    $("lat-text").textContent = r.ttft_ms != null ? fmtMs(r.ttft_ms) : "–";
  }
}
