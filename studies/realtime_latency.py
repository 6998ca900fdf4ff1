"""Latency through the Realtime WebSocket (`/v1/realtime`) as its client hears it, with the official `openai` client
(pip install -e '.[test]'): a WAV streamed in real time as 20 ms `input_audio_buffer.append` events and, per
utterance, the time from the end of its speech to the first answer audio that arrives (a
`response.output_audio.delta` with sound in it), next to the server's `response.done` metrics. The same WAV and
measure as `rtc-agent call --json` for the WebRTC path.

    .venv/bin/python -m studies.realtime_latency http://127.0.0.1:8080 --wav three.wav [--key TOKEN]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from typing import Any

import numpy as np
from openai import AsyncOpenAI

from rtc_agent.client.microphone import load_audio, speech_spans
from rtc_agent.media.pcm import PCM_RATE, to_pcm16

PIECE = PCM_RATE // 50  # 20 ms, as a microphone delivers it
SOUND = 1e-3 * 32767  # the level `rtc-agent call` counts as sound


async def measure(url: str, wav: str, key: str, answer_timeout_s: float) -> dict[str, Any]:
    samples = load_audio(wav, PCM_RATE)
    spans = speech_spans(samples, PCM_RATE)
    client = AsyncOpenAI(api_key=key, base_url=url + "/v1", websocket_base_url=url.replace("http", "ws", 1) + "/v1")
    received: list[tuple[float, Any]] = []
    async with client.realtime.connect(model="rtc-agent") as conn:
        async def read() -> None:
            async for event in conn:
                received.append((time.monotonic(), event))

        reader = asyncio.create_task(read())
        start = time.monotonic()
        for i in range(0, len(samples), PIECE):
            await asyncio.sleep(max(0.0, start + i / PCM_RATE - time.monotonic()))
            await conn.input_audio_buffer.append(audio=base64.b64encode(to_pcm16(samples[i:i + PIECE])).decode())
        deadline = time.monotonic() + answer_timeout_s
        while sum(e.type == "response.done" for _, e in received) < len(spans) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        reader.cancel()
    dones = [e.response for _, e in received if e.type == "response.done"]
    turns = []
    for i, (_, end) in enumerate(spans):
        t_end = start + end / PCM_RATE
        t_next = start + spans[i + 1][0] / PCM_RATE if i + 1 < len(spans) else float("inf")
        heard = next((t for t, e in received if e.type == "response.output_audio.delta" and t_end <= t < t_next
                      and np.abs(np.frombuffer(base64.b64decode(e.delta), "<i2")).max() > SOUND), None)
        done = dones[i] if i < len(dones) else None
        turns.append({"speech_end_s": round(end / PCM_RATE, 3),
                      "client_latency_ms": None if heard is None else round((heard - t_end) * 1000, 1),
                      "status": done.status if done else "no answer",
                      "server": done.model_extra.get("metrics") if done else None})
    return {"url": url, "transport": "websocket", "turns": turns}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--wav", required=True, help="utterances separated by pauses of a second or more")
    p.add_argument("--key", default="none", help="the server token or a client secret (any value without --token)")
    p.add_argument("--answer-timeout-s", type=float, default=30.0)
    args = p.parse_args()
    print(json.dumps(asyncio.run(measure(args.url.rstrip("/"), args.wav, args.key, args.answer_timeout_s)), indent=1))


if __name__ == "__main__":
    main()
