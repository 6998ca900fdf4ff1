"""Prometheus metrics, in a registry of the app's own (several apps can live in one test process)."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..loop_lag import watched_process

LATENCY_BUCKETS_MS = (25, 50, 75, 100, 150, 200, 250, 300, 400, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000)
STEP_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 5000)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.first_packet_ms = Histogram(
            "audio_first_packet_latency_ms", "End of the caller's turn to the answer's first packet handed to RTP",
            buckets=LATENCY_BUCKETS_MS, registry=r)
        self.end_of_turn_wait_ms = Histogram(
            "rtc_agent_end_of_turn_wait_ms", "Silence after the caller's speech before the turn was ended, by the "
            "turn detection that ended it", ["type"], buckets=LATENCY_BUCKETS_MS, registry=r)
        # GPU memory, read live (engine/model/memory.py says what counts); all three are 0 without a GPU
        self.gpu_used_gb = Gauge("gpu_memory_used_gb", "GPU memory in use: the engine's tensors plus what is used "
                                 "outside PyTorch's allocator (0: no GPU)", registry=r)
        self.gpu_total_gb = Gauge("gpu_memory_total_gb", "GPU memory this process may use: the GPU's, times "
                                  "--gpu-memory-fraction (0: no GPU)", registry=r)
        self.gpu_peak_gb = Gauge("gpu_memory_peak_gb", "Peak GPU memory of the engine's tensors (0: no GPU)",
                                 registry=r)
        self.memory_guard = Gauge("rtc_agent_memory_guard_active", "1 while GPU memory use is above "
                                  "--memory-guard-pct (no new calls)", registry=r)
        self.drop_ratio = Gauge("drop_audio_frame_ratio",
                                "Answer frames not sent in time (made more than 40 ms after their 80 ms slot, which "
                                "a silence packet filled: the engine was slower than real time) / answer frames made; "
                                "the network does not enter it", registry=r)
        self.input_packets = Counter("rtc_agent_input_audio_packets",
                                     "Caller audio packets that arrived, by what the server did with them: kept "
                                     "(decoded) or dropped (arrived after a newer one: reordered or duplicated)",
                                     ["outcome"], registry=r)
        self.input_drop_ratio = Gauge("rtc_agent_input_audio_drop_ratio",
                                      "Caller audio packets the server dropped / caller audio packets that arrived "
                                      "(packets the network lost never arrive and are not in it)", registry=r)
        self.active_sessions = Gauge("rtc_agent_active_sessions", "Calls in progress", registry=r)
        self.sessions = Counter("rtc_agent_sessions", "Calls started", registry=r)
        self.rejected = Counter("rtc_agent_offers_rejected", "Offers refused", ["reason"], registry=r)
        self.connections_refused = Counter("rtc_agent_connections_refused",
                                           "HTTP connections closed at once: max_connections were open", registry=r)
        self.turns = Counter("rtc_agent_turns", "Caller turns answered", ["status"], registry=r)
        self.frames = Counter("rtc_agent_output_frames", "Answer frames by outcome", ["outcome"], registry=r)
        self.engine_ms = Histogram("rtc_agent_engine_step_ms", "Engine timings reported per answer",
                                   ["metric"], buckets=STEP_BUCKETS_MS, registry=r)
        self.video_frames_received = Counter("rtc_agent_video_frames_received",
                                             "Caller video frames received (every frame the caller sends)", registry=r)
        self.video_frames_sampled = Counter("rtc_agent_video_frames_sampled",
                                            "Caller video frames kept for the model (video_fps a second)", registry=r)
        self.ready = Gauge("rtc_agent_ready", "1 once the model is loaded and warmed up", registry=r)
        self.loop_lag, self.gc_pauses = watched_process(r)
        self._made = self._late = 0
        self._input_arrived = self._input_dropped = 0

    def show_memory(self, use: Any) -> None:
        """A memory reading (engine MemoryUse, or None: no GPU) into the gauges."""
        for gauge, value in ((self.gpu_used_gb, use and use.used_bytes), (self.gpu_total_gb, use and use.total_bytes),
                             (self.gpu_peak_gb, use and use.peak_bytes)):
            gauge.set((value or 0) / 1e9)

    def answer(self, m: dict[str, Any]) -> None:
        """One answer's metrics, as in response.done."""
        status = "interrupted" if m["interrupted"] else "completed"
        self.turns.labels(status).inc()
        if m["ttfp_ms"] is not None:
            self.first_packet_ms.observe(m["ttfp_ms"])
        end = m.get("end_of_turn", {})
        if end.get("wait_ms") is not None:
            self.end_of_turn_wait_ms.labels(end["type"]).observe(end["wait_ms"])
        self.frames.labels("made").inc(m["frames"])
        self.frames.labels("sent").inc(m["frames_sent"])
        self.frames.labels("late").inc(m["frames_late"])
        self.frames.labels("dropped").inc(m["frames_dropped"])
        self._made += m["frames"]
        self._late += m["frames_late"]
        self.drop_ratio.set(self._late / self._made if self._made else 0.0)
        for name, value in m.get("engine", {}).items():
            if name.endswith("_ms") and isinstance(value, (int, float)):
                self.engine_ms.labels(name).observe(value)

    def input_audio_packet(self, kept: bool) -> None:
        """One caller audio packet arrived at a call's receiver (media.inbound.InOrderAudioBuffer)."""
        self.input_packets.labels("kept" if kept else "dropped").inc()
        self._input_arrived += 1
        self._input_dropped += not kept
        self.input_drop_ratio.set(self._input_dropped / self._input_arrived)

    def render(self) -> bytes:
        return generate_latest(self.registry)
