"""A prepared answer against the same turn answered at its end, on the device the engine finds (a GPU: CUDA graphs,
the side stream, the first frame made in the preparation), and a preparation undone by more speech against a turn
never paused. tests/offline/test_engine_prepare.py checks the same on the CPU; the tiny model does not load on CUDA,
so on a GPU this runs a full-size synthetic model. Prints each answer's tokens and digests of its frames' codes and
samples (two versions of the code can be compared by them too), then whether the pairs are equal.

    python3 -m studies.prepared_check [--model synthetic:30b-a3b]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from typing import Any

import numpy as np

from rtc_agent.engine.events import ResponseDone, SpeechFrame
from rtc_agent.engine.options import EngineOptions, SessionOptions
from rtc_agent.engine.session.engine import Engine
from studies.burst_profile import caller_audio

OPTIONS = SessionOptions(seed=7, max_answer_tokens=10, max_frames=12)  # seeded sampling: a lost draw shows


async def answers(engine: Engine, pieces: list[Any]) -> list[dict[str, Any]]:
    """One new session through `pieces`: audio is pushed, "prepare" prepares, "respond" ends a turn."""
    session = engine.new_session(OPTIONS)
    out = []
    for piece in pieces:
        if isinstance(piece, np.ndarray):
            for start in range(0, len(piece), 320):
                await session.push_audio(piece[start:start + 320])
        elif piece == "prepare":
            await session.prepare_answer()
        else:
            codes, samples, done = [], hashlib.sha1(), None
            async for event in session.respond():
                if isinstance(event, SpeechFrame):
                    codes.append(list(event.codes))
                    samples.update(event.samples.tobytes())
                elif isinstance(event, ResponseDone):
                    done = event
            out.append({"tokens": list(done.token_ids), "frames": len(codes),
                        "codes": hashlib.sha1(json.dumps(codes).encode()).hexdigest()[:12],
                        "samples": samples.hexdigest()[:12]})
    await session.close()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:30b-a3b")
    args = parser.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, max_sessions=2, first_frame_in_preparation=True))
    await engine.warmup()
    said, more, after = caller_audio(1.7, 4), caller_audio(0.9, 8), caller_audio(1.2, 5)
    runs = {"prepared": [said, "prepare", "respond", after, "prepare", "respond"],
            "at_the_end": [said, "respond", after, "respond"],
            "undone": [said, "prepare", more, "respond"],
            "never_paused": [said, more, "respond"]}
    results = {name: await answers(engine, pieces) for name, pieces in runs.items()}
    for name, result in results.items():
        print(name, json.dumps(result))
    print("prepared == at_the_end:", results["prepared"] == results["at_the_end"])
    print("undone == never_paused:", results["undone"] == results["never_paused"])


if __name__ == "__main__":
    asyncio.run(main())
