// While connected: the connection's stats line in the settings dialog (round trip, packets, video) once a
// second, and the orb's level from the caller's or the agent's meter every frame.
import { $ } from "./dom.js";

/** The stats of the App `app`'s call (its call, state and media). */
export class Stats {
  constructor(app) {
    this.app = app;
    this._timer = null;
    this._raf = 0;
    this._prev = null;
  }

  start() {
    this.stop();
    this._timer = setInterval(() => this.render(), 1000);
    const { media } = this.app;
    const tick = () => {
      this._raf = requestAnimationFrame(tick);
      const speaking = this.app.state === "speaking";
      const level = speaking ? media.agentMeter?.level ?? 0 : (media.micTrack?.enabled ? media.micMeter?.level ?? 0 : 0);
      const v = Math.min(1, Math.sqrt(level) * 3);
      const orb = $("orb");
      const prev = Number(orb.dataset.level || 0);
      const next = v > prev ? v : prev * 0.85 + v * 0.15;
      orb.dataset.level = String(next);
      orb.style.setProperty("--level", next.toFixed(3));
    };
    tick();
  }

  stop() {
    clearInterval(this._timer);
    cancelAnimationFrame(this._raf);
    $("orb").style.setProperty("--level", "0");
  }

  async render() {
    const line = $("stats");
    const s = await this.app.call?.stats();
    if (!s) {
      line.textContent = "";
      return;
    }
    const prev = this._prev;
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
    this._prev = { ...s, at: now };
    line.textContent = parts.length ? `Connection: ${parts.join(" · ")}` : "";
  }
}
