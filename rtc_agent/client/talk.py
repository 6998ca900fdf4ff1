"""`rtc-agent talk URL`: a live call from this machine's microphone and speaker (sounddevice + PortAudio)."""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any

import numpy as np

from ..media.ice import use_host_addresses
from .microphone import RATE as MIC_RATE
from .microphone import Microphone
from .peer import RECORD_RATE, Call, server_ice_servers


def _sounddevice() -> Any:
    try:
        import sounddevice
    except ImportError as exc:
        raise SystemExit("talk needs sounddevice and PortAudio: `.venv/bin/pip install -e '.[talk]'` and "
                         f"`apt-get install libportaudio2` ({exc})") from None
    except OSError as exc:
        raise SystemExit(f"talk needs PortAudio: `apt-get install libportaudio2` ({exc})") from None
    try:
        sounddevice.query_devices(kind="input")
        sounddevice.query_devices(kind="output")
    except Exception as exc:
        raise SystemExit(f"talk needs a microphone and a speaker: {exc}") from None
    return sounddevice


class Speaker:
    """Plays received frames as they come; starts empty and never waits (a late frame is a short gap)."""

    def __init__(self) -> None:
        self._blocks: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        self._pending = np.zeros(0, np.float32)

    def add(self, samples: np.ndarray) -> None:
        with self._lock:
            self._blocks.append(samples)

    def fill(self, out: np.ndarray) -> None:
        """PortAudio callback side: `out` is (frames, 1) float32."""
        need = len(out)
        with self._lock:
            while len(self._pending) < need and self._blocks:
                self._pending = np.concatenate([self._pending, self._blocks.popleft()])
        take = min(need, len(self._pending))
        out[:take, 0] = self._pending[:take]
        out[take:, 0] = 0.0
        self._pending = self._pending[take:]


async def run_talk(url: str, *, token: str | None = None, voice: str | None = None, instructions: str | None = None,
                   verify_tls: bool = True, ice_servers: tuple[str, ...] = (),
                   ice_host_addresses: tuple[str, ...] = (), relay_only: bool = False) -> int:
    sd = _sounddevice()
    use_host_addresses(ice_host_addresses)
    loop = asyncio.get_running_loop()
    mic, speaker = Microphone(), Speaker()
    servers = ice_servers or await server_ice_servers(url, token, verify_tls)
    call = Call(url, token=token, voice=voice, instructions=instructions, ice_servers=servers,
                relay_only=relay_only, verify_tls=verify_tls, on_audio=speaker.add)

    def captured(indata: np.ndarray, frames: int, time: Any, status: Any) -> None:
        loop.call_soon_threadsafe(mic.play, indata[:, 0].copy())

    def playback(outdata: np.ndarray, frames: int, time: Any, status: Any) -> None:
        speaker.fill(outdata)

    await call.connect(mic)
    print(f"connected ({call.session_id}); speak, Ctrl-C hangs up")
    with sd.InputStream(samplerate=MIC_RATE, channels=1, dtype="float32", blocksize=960, callback=captured), \
         sd.OutputStream(samplerate=RECORD_RATE, channels=1, dtype="float32", blocksize=480, callback=playback):
        try:
            while True:
                msg = await call.queue.get()
                kind = msg["type"]
                if kind == "response.output_audio_transcript.delta":
                    print(msg["delta"], end="", flush=True)
                elif kind == "response.done":
                    m = msg["response"]["metrics"]
                    print(f"   [{msg['response']['status']}, first packet {m['ttfp_ms']} ms after your turn]")
                elif kind == "input_audio_buffer.speech_started":
                    print("(you) ...", flush=True)
                elif kind == "error":
                    print(f"error: {msg['error']['message']}")
        except (asyncio.CancelledError, KeyboardInterrupt):
            pass
        finally:
            await call.hang_up()
    return 0
