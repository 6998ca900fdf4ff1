// Audio level meter, run on the audio thread: reports the level about 20 times a second, and the exact
// render time of the first block above a threshold once "armed" (the page's own time-to-first-heard-audio).
class LevelMeter extends AudioWorkletProcessor {
  constructor() {
    super();
    this.threshold = 0.0005; // RMS; the page sets its own
    this.armed = false;
    this.sum = 0;
    this.peak = 0;
    this.count = 0;
    this.lastLoud = -1; // currentTime of the last block above threshold
    this.port.onmessage = (e) => {
      const m = e.data;
      if (typeof m.threshold === "number") this.threshold = m.threshold;
      if (typeof m.armed === "boolean") this.armed = m.armed;
    };
  }

  process(inputs) {
    const input = inputs[0];
    if (input && input.length) {
      const ch = input[0];
      let sum = 0;
      for (let i = 0; i < ch.length; i++) sum += ch[i] * ch[i];
      const rms = Math.sqrt(sum / ch.length);
      if (rms > this.threshold) {
        this.lastLoud = currentTime;
        if (this.armed) {
          this.armed = false;
          this.port.postMessage({ type: "onset", time: currentTime, rms });
        }
      }
      this.sum += sum;
      this.count += ch.length;
      if (rms > this.peak) this.peak = rms;
      if (this.count >= sampleRate / 20) {
        this.port.postMessage({
          type: "level", time: currentTime, rms: Math.sqrt(this.sum / this.count), peak: this.peak,
          lastLoud: this.lastLoud,
        });
        this.sum = 0;
        this.count = 0;
        this.peak = 0;
      }
    }
    return true;
  }
}

registerProcessor("level-meter", LevelMeter);
