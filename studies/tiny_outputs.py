#!/usr/bin/env python3
"""The tiny model's answers for fixed seeds, as one JSON line each: a refactor that changes no behaviour leaves
them the same token for token (text tokens, and a digest of every speech frame's 16 codebook ids).

    git worktree add /tmp/before REV
    (cd /tmp && PYTHONPATH=/tmp/before ~/rtc-agent/.venv/bin/python ~/rtc-agent/studies/tiny_outputs.py) > before
    .venv/bin/python -m studies.tiny_outputs > after && diff before after

Three sessions (seeds 0, 1, 2), two turns each of 2 s of seeded noise, answers of 24 tokens, after the warm-up.
"""
from __future__ import annotations

import asyncio
import hashlib
import json

import numpy as np

from rtc_agent.engine import Engine, EngineOptions, SessionOptions
from rtc_agent.engine.events import SpeechFrame, TextDelta


async def answers() -> list[dict[str, object]]:
    engine = Engine.load(EngineOptions(model="tiny", device="cpu"))
    await engine.warmup()
    out: list[dict[str, object]] = []
    for seed in (0, 1, 2):
        session = engine.new_session(SessionOptions(seed=seed, max_answer_tokens=24))
        noise = np.random.default_rng(seed)
        for turn in range(2):
            await session.push_audio((noise.standard_normal(16_000 * 2) * 0.1).astype(np.float32))
            tokens, codes = [], []
            async for event in session.respond():
                if isinstance(event, TextDelta):
                    tokens.append(event.token_id)
                elif isinstance(event, SpeechFrame):
                    codes.append(",".join(map(str, event.codes)))
            out.append({"seed": seed, "turn": turn, "tokens": tokens, "frames": len(codes),
                        "codes": hashlib.sha256("|".join(codes).encode()).hexdigest()[:16]})
        await session.close()
    return out


if __name__ == "__main__":
    for answer in asyncio.run(answers()):
        print(json.dumps(answer))
