"""Smart Turn's verdicts for every call, on the engine's GPU, batched (the server's --end-of-turn-on engine, and
with the default on a GPU, overflow: the decisions a media process asks for while one of its own is under way,
and that one too).

Why: on the CPU each verdict is 60-100 ms of a core. When many callers stop together their verdicts queue for the
cores beside everything else the calls need (32 turns ending at once on the H200 machine's 16 cores: verdicts
after 240-268 ms P50, and the media processes' event loops 22-27 ms late). On the GPU a batch of 32 is 26 ms, one
turn 2.5 ms: verdicts after 7-8 ms, loops at most 5.5 ms late. Every verdict from here is not the default: these
are not onnxruntime's verdicts, those the thresholds were chosen on (docs/turn-taking.md). With overflow a lone
caller's verdicts stay onnxruntime's and a burst's come from here. The media processes send the turn's audio
(remote.py) and wait for the verdict; the last words, where heard, stay on their CPUs.

The model is the same file onnxruntime runs, as torch ops (engine/step/onnx_torch.py), features included, captured as a
CUDA graph per batch size (about 700 kernels: launched one by one from Python they took 20 ms for one turn while
the worker's thread held the GIL). It runs on a thread of its own and a CUDA stream of high priority, beside the
worker's: a verdict does not wait for a decode step or a round to end, and its kernels go ahead of theirs on the
GPU. Requests that arrive while a batch runs go together in the next one. The graphs are captured after the
engine's warm-up, so no capture meets another.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time

import numpy as np
import torch

from ...smart_turn import RATE, WINDOW_S, model_installed, model_path, windows
from .audio_input import LogMel
from .graphs import CapturedStep, HostCopy
from .onnx_torch import TorchGraph

log = logging.getLogger(__name__)
# The batch sizes graphs are captured for; a batch is padded to the next. 24, the default's slots: a burst of 24
# callers' verdicts padded to 32 would cost the GPU a third more, beside the burst's preparations.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32)
MAX_BATCH = BATCH_SIZES[-1]  # turns a batch (memory: 32 x 8 s windows are ~0.5 GB of activations)


def end_of_turn_mode(asked: str, device: torch.device) -> str:
    """Where an engine on `device` has its calls' turns scored (EngineOptions.end_of_turn, resolved): auto is
    overflow on a GPU where Smart Turn's file is installed, media elsewhere (on a CPU the engine's work and the
    media processes' share the same few cores)."""
    if asked != "auto":
        return asked
    return "overflow" if device.type == "cuda" and model_installed() else "media"


class DeviceTurnModel:
    """P(turn complete) for a batch of turns' audio (16 kHz mono float32), on `device`: one graph per batch size
    (BATCH_SIZES), a batch padded to the next (on a CPU the same code runs eagerly).

    Its input is what EndOfTurnModel gives onnxruntime, made on the device: each turn's `windows` normalised to
    zero mean and unit variance, as Whisper log-mel features (80 bins) by the engine's own LogMel with the
    extractor's mel filters; the two agree to 2e-5 (tests/test_end_of_turn.py). (A verdict moves by up to 0.05
    with that: the model's int8 input grid.)"""

    def __init__(self, device: torch.device) -> None:
        from transformers import WhisperFeatureExtractor

        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device, priority=-1) if cuda else None  # -1: high priority
        self._log_mel = LogMel(WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE, chunk_length=WINDOW_S),
                               device)
        self._graph = TorchGraph(model_path(), device)
        # A batch's audio goes in and its verdicts come out through pinned memory, waited for by an event: a
        # plain copy from or to pageable memory waits for the GPU inside the driver, where (measured on the H200)
        # the worker thread's launches then waited too, for the whole batch.
        self._host_input = torch.zeros(MAX_BATCH, RATE * WINDOW_S, pin_memory=True) if cuda else None
        self._verdicts = HostCopy((MAX_BATCH,), torch.float32, device)
        pool = torch.cuda.graph_pool_handle() if cuda else None  # (one batch at a time: the graphs share memory)
        self._steps: dict[int, CapturedStep] = {}
        with self._on_stream():
            for rows in BATCH_SIZES if cuda else []:
                example = torch.from_numpy(windows([np.zeros(16_000, np.float32)] * rows)).to(device)
                self._steps[rows] = CapturedStep(self._probabilities, example, stream=self.stream, pool=pool)

    def __call__(self, turns: list[np.ndarray]) -> list[float]:
        rows = next((size for size in self._steps if size >= len(turns)), len(turns))  # (CPU: any, eagerly)
        padded = turns + [np.zeros(0, np.float32)] * (rows - len(turns))
        with self._on_stream():
            if self._host_input is None:
                x = torch.from_numpy(windows(padded))
            else:  # (pinned: rewritten only after the last batch's verdicts, which come after its copy, are back)
                x = self._host_input[:rows]
                windows(padded, out=x.numpy())
                x = x.to(self.device, non_blocking=True)
            self._verdicts.start(self._steps.get(rows, self._probabilities)(x)[:len(turns)])
            return self._verdicts.get()[:len(turns)].tolist()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The model's input [turns, 80, 800] for turns' `windows` [turns, RATE x WINDOW_S] on the device."""
        x = (x - x.mean(1, keepdim=True)) / torch.sqrt(x.var(1, unbiased=False, keepdim=True) + 1e-7)
        return self._log_mel.batch(x)

    def _probabilities(self, x: torch.Tensor) -> torch.Tensor:
        (p,) = self._graph(self.features(x))
        return p.reshape(-1)

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


class TurnScoring:
    """The engine's scorer: `score(audio)` from any event loop; the batches run on a thread of their own."""

    def __init__(self, model: DeviceTurnModel) -> None:
        self.model = model
        self._pending: list[tuple[np.ndarray, concurrent.futures.Future[tuple[float, float]]]] = []
        self._wake = threading.Condition()
        self._closed = False
        self.batches = 0
        self._thread = threading.Thread(target=self._loop, name="end-of-turn-device", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, device: torch.device) -> "TurnScoring":
        return cls(DeviceTurnModel(device))

    async def score(self, audio: np.ndarray) -> tuple[float, float]:
        """(P(turn complete), milliseconds its batch took on the scorer's thread)."""
        future: concurrent.futures.Future[tuple[float, float]] = concurrent.futures.Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine's end-of-turn scorer is closed")
            self._pending.append((np.asarray(audio, np.float32), future))
            self._wake.notify()
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    for _, future in self._pending:
                        future.cancel()
                    return
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            batch = [(audio, future) for audio, future in batch if future.set_running_or_notify_cancel()]
            if not batch:  # (every caller of it stopped waiting)
                continue
            started = time.perf_counter()
            try:
                probabilities = self.model([audio for audio, _ in batch])
            except Exception as exc:  # (each caller's turn falls back to its late checks: SemanticTurn)
                log.exception("end-of-turn batch of %d failed", len(batch))
                for _, future in batch:
                    future.set_exception(exc)
                continue
            ms = round((time.perf_counter() - started) * 1000, 2)
            self.batches += 1
            for (_, future), p in zip(batch, probabilities):
                future.set_result((p, ms))
