"""`rtc-agent bench`: time to first packet and per-frame cost of the streaming engine, in process, against stock
`generate(return_audio=True)` on the same inputs in the same run."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import language as languages
from ..loop_lag import LoopLag
from .events import INPUT_SAMPLE_RATE, ResponseDone, SpeechFrame, ToolCallDone
from .model.kernels import attention, moe, norm, rotary
from .options import QUANTIZE_CHOICES, EngineOptions, SessionOptions
from .scheduler.policy import PREPARE_AFTER_SILENCE_MS
from .session.engine import Engine
from .step import audio_input, sampling
from .step.graphs import rows_for
from .step.tools import AnswerCalls, Tool, ToolSet

FRAME_S = 0.08
# Five kinds of schema a car or phone assistant offers (enums and bounded numbers, arrays, a nested object, bounded
# integers, a pattern and a const), for `--tools` and the tests.
BENCH_TOOLS = (
    Tool.function("set_heating", "Set the cabin temperature of a zone.", {
        "type": "object",
        "properties": {"zone": {"enum": ["front", "back", "all"]},
                       "celsius": {"type": "number", "minimum": 16, "maximum": 28}},
        "required": ["zone", "celsius"]}),
    Tool.function("add_to_list", "Add items to a shopping or to-do list.", {
        "type": "object",
        "properties": {"list": {"type": "string"},
                       "items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                 "minItems": 1, "maxItems": 3}},
        "required": ["list", "items"]}),
    Tool.function("navigate", "Start route guidance.", {
        "type": "object",
        "properties": {"destination": {"type": "object",
                                       "properties": {"name": {"type": "string", "maxLength": 20},
                                                      "kind": {"enum": ["home", "work", "address"]}},
                                       "required": ["kind"]},
                       "avoid_tolls": {"type": "boolean"}},
        "required": ["destination"]}),
    Tool.function("set_timer", "Start a countdown.", {
        "type": "object",
        "properties": {"minutes": {"type": "integer", "minimum": 0, "maximum": 90},
                       "seconds": {"type": "integer", "minimum": 0, "maximum": 59}},
        "required": ["minutes", "seconds"]}),
    Tool.function("call_contact", "Phone someone on the car's speakers.", {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{6,12}$"},
                       "speaker": {"const": True}},
        "required": ["phone", "speaker"]}),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny | synthetic:30b-a3b | path to a checkpoint")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                        help="INT4 weights for the experts and attention (int4.py)")
    parser.add_argument("--turns", type=int, default=5, help="caller turns per session")
    parser.add_argument("--sessions", type=int, default=1, help="callers at once, each its own session")
    parser.add_argument("--max-sessions", type=int, help="session slots to make (default: --sessions)")
    parser.add_argument("--turn-s", type=float, default=3.0, help="seconds of caller speech per turn")
    parser.add_argument("--silence-ms", type=int, default=400,
                        help="silence after the speech before the answer is asked for, as the call server's hang-over "
                             "(it has the engine prefill what it has after 160 ms of it)")
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--answer-frames", type=int, default=40)
    parser.add_argument("--prefill-chunk-s", type=float, default=1.0)
    parser.add_argument("--context-tokens", type=int, help="KV cache per session (default 8192, more for --video-s)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager decode steps (to measure the graphs)")
    parser.add_argument("--no-fast-moe", action="store_true",
                        help="the library's MoE path in decode and prefill too (moe.py, grouped.py)")
    parser.add_argument("--no-fast-attention", action="store_true",
                        help="the library's SDPA in decode too (attention.py)")
    parser.add_argument("--no-fast-norm", action="store_true", help="the library's RMSNorm (norm.py)")
    parser.add_argument("--no-fast-rotary", action="store_true",
                        help="the library's q/k norm, rotary embedding and cache write in graphed steps (rotary.py)")
    parser.add_argument("--no-fast-sampling", action="store_true",
                        help="the Talker's and code predictor's draws as separate kernels (sampling.py)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="the Thinker's next token after each frame, not next to it on a side stream")
    parser.add_argument("--video-s", type=float, default=0.0,
                        help="seconds of 2 fps camera before each question (the camera stays on while it is asked)")
    parser.add_argument("--video-size", default="384x288", help="camera frame size, WIDTHxHEIGHT")
    parser.add_argument("--no-talker", action="store_true",
                        help="text only: load neither the Talker nor Code2Wav (time to first text token, memory)")
    parser.add_argument("--no-audio-stream", action="store_true",
                        help="answers come out only once all of them is made (answer_ms is then the first packet)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=1.0,
                        help="cap the process at this fraction of the GPU's memory, before the weights load")
    parser.add_argument("--tools", choices=("none", "auto", "required", "named"), default="none",
                        help="offer every session the five BENCH_TOOLS: auto (the model may call; the answers are "
                             "the same kind), required (every answer is a call, its JSON held to its schema), named "
                             "(every answer calls the tool whose turn it is, each in turn)")
    parser.add_argument("--language", choices=list(languages.LANGUAGES),
                        help="every session's language lock (rtc_agent/language.py); stage_ms then has "
                             "thinker_token_language, a Thinker token of every row under the lock")
    parser.add_argument("--compare-stock", action="store_true", help="also time stock generate on the same turn")
    parser.add_argument("--stock-runs", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_bench(args))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:  # e.g. no packets with --no-talker: null in the JSON (NaN is not JSON)
        return {"p50": None, "p90": None}
    return {"p50": round(float(np.percentile(values, 50)), 2), "p90": round(float(np.percentile(values, 90)), 2)}


def _caller_turn(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * INPUT_SAMPLE_RATE)) / INPUT_SAMPLE_RATE
    tone = np.sin(2 * np.pi * (140 + 30 * np.sin(2 * np.pi * 0.5 * t)) * t)
    return (0.2 * tone + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def _camera(seconds: float, width: int, height: int, start: float, seed: int) -> list[tuple[float, np.ndarray]]:
    """2 fps frames that change every time (a drifting gradient with noise), stamped from `start`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for n in range(int(seconds * 2)):
        image = np.stack([(x + 7 * n) % 256, (y + 11 * n) % 256, (x + y + 13 * n) % 256], axis=-1)
        frames.append((start + 0.5 * n, np.clip(image + rng.integers(-16, 16, image.shape), 0, 255).astype(np.uint8)))
    return frames


def _system_prompt(tokenizer, count: int) -> str:
    words = ("You are a helpful assistant on a live voice call. Keep answers short, warm and clear. " * 200).split(" ")
    text = ""
    for word in words:
        candidate = f"{text} {word}".strip()
        if len(tokenizer.encode(candidate, add_special_tokens=False)) > count:
            break
        text = candidate
    return text


def _cpu_s(engine: Engine) -> tuple[float, float]:
    """CPU seconds so far of this process and of the engine's worker thread (Linux: /proc)."""
    times = os.times()
    fields = Path(f"/proc/self/task/{engine.worker_thread_id}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return times.user + times.system, (int(fields[11]) + int(fields[12])) / ticks


def _log(args, message: str) -> None:
    if not args.json:
        print(message, flush=True)


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    width, height = (int(side) for side in args.video_size.split("x"))
    window = math.ceil(args.video_s + args.turn_s) if args.video_s else 0
    video_tokens = window * (round(width / 32) * round(height / 32) + 13)  # a second of video with its audio
    engine = Engine.load(EngineOptions(model=args.model, device=args.device, quantize=args.quantize,
                                       prefill_chunk_s=args.prefill_chunk_s,
                                       max_answer_tokens=max(args.answer_tokens, 16),
                                       max_frames=max(args.answer_frames, 16), cuda_graphs=not args.no_cuda_graphs,
                                       fast_moe=not args.no_fast_moe, fast_attention=not args.no_fast_attention,
                                       fast_norm=not args.no_fast_norm, fast_rotary=not args.no_fast_rotary,
                                       fast_sampling=not args.no_fast_sampling,
                                       overlap=not args.no_overlap, video_window_s=window,
                                       max_sessions=args.max_sessions or args.sessions,
                                       text_only=args.no_talker, streaming=not args.no_audio_stream,
                                       gpu_memory_fraction=args.gpu_memory_fraction,
                                       context_tokens=args.context_tokens or
                                       max(8192, 2 ** math.ceil(math.log2(video_tokens * 1.5 + 2048)))))
    loaded = time.perf_counter()
    await engine.warmup()
    ready = time.perf_counter()
    _log(args, f"loaded in {loaded - started:.1f} s, warmed up in {ready - loaded:.1f} s")
    instructions = _system_prompt(engine.tokenizer, args.system_tokens)
    tools = ToolSet(BENCH_TOOLS, args.tools if args.tools != "named" else "required") if args.tools != "none" \
        else ToolSet()
    sessions = [engine.new_session(SessionOptions(instructions=instructions, seed=n,
                                                  max_answer_tokens=args.answer_tokens,
                                                  max_frames=args.answer_frames, tools=tools,
                                                  language=args.language))
                for n in range(args.sessions)]
    lag = LoopLag()
    watching = asyncio.create_task(lag.watch())
    cpu_before, wall_before = _cpu_s(engine), time.perf_counter()
    callers = await asyncio.gather(*(_caller(session, args, width, height, n) for n, session in enumerate(sessions)))
    cpu_after, wall = _cpu_s(engine), time.perf_counter() - wall_before
    watching.cancel()
    stages = await engine.run(_stage_times, engine, [s.context for s in sessions]) if engine.speech else {}
    encoder = await engine.run(_encoder_times, engine)
    video = sessions[0].video_stats()
    for session in sessions:
        await session.close()
    ttfp = [ms for caller in callers for ms in caller["ttfp"]]
    frame_ms = [ms for caller in callers for ms in caller["frame_ms"]]
    rtf = [caller["busy_s"] / caller["audio_s"] for caller in callers if caller["audio_s"]]
    result: dict[str, Any] = {
        "model": args.model, "device": _device_name(engine), "dtype": engine.describe()["dtype"],
        "quantize": engine.describe()["quantize"],
        "context_tokens": engine.options.context_tokens, "sessions": args.sessions, "slots": len(engine.pool),
        "turns": args.turns,
        "turn_s": args.turn_s, "silence_ms": args.silence_ms, "system_tokens": args.system_tokens,
        "prefill_chunk_s": args.prefill_chunk_s,
        "cuda_graphs": engine.cuda_graphs, "fast_moe": moe.active(engine.model),
        "fast_attention": attention.active(engine.model), "overlap": engine.options.overlap and engine.cuda_graphs,
        "fast_norm": norm.active(engine.model), "fast_rotary": rotary.active(engine.model),
        "fast_sampling": sampling.fused_active(engine.options.fast_sampling, engine.device),
        "speech": engine.speech, "streaming": engine.options.streaming,
        "ttfp_ms": _percentiles(ttfp),
        "ttfp_ms_first_turn": round(callers[0]["ttfp"][0], 2) if callers[0]["ttfp"] else None,
        "answer_ms": _percentiles([ms for caller in callers for ms in caller["answer_ms"]]),
        "ttfp_ms_turns": [round(ms, 1) for ms in callers[0]["ttfp"]],
        "ttft_ms_turns": [round(ms, 1) for ms in callers[0]["ttft"]],
        "ttft_ms": _percentiles([ms for caller in callers for ms in caller["ttft"]]),
        "frame_ms": _percentiles(frame_ms),
        "rtf": round(max(rtf), 3) if rtf else None, "startup_s": round(ready - started, 1),
        "warmup_s": round(ready - loaded, 1), "gpu_peak_gb": _round(engine.gpu_peak_gb()), "stage_ms": stages,
        "audio_encoder_ms": encoder,
        # while the callers talked and were answered: this process's CPU and its engine worker thread's, in % of
        # one core, and how late the event loop (the sessions' requests) woke up
        "process": {"cpu_pct": round(100 * (cpu_after[0] - cpu_before[0]) / wall, 1),
                    "worker_thread_cpu_pct": round(100 * (cpu_after[1] - cpu_before[1]) / wall, 1),
                    "loop_lag_ms_max": round(lag.max_ms, 1)},
    }
    per_token = [ms for caller in callers for ms in caller["token_ms"]]
    result["token_ms"] = _percentiles(per_token)  # written answers: from the first token to the last, per token
    if args.tools != "none":
        calls = [call for caller in callers for call in caller["calls"]]
        result["tools"] = {"choice": args.tools, "calls": len(calls), "answers": len(per_token),
                           "grammar_ms_per_token": _percentiles([ms for c in callers for ms in c["grammar_ms"]]),
                           "made": [{"name": c.name, "arguments": c.arguments} for c in calls]}
    if args.video_s:
        result["video"] = {"camera_s_before_question": args.video_s, "size": args.video_size, "window_s": window,
                           "context_tokens": engine.options.context_tokens,
                           "seconds_in_context": video["seconds_in_context"],
                           "tokens_in_context": video["tokens_in_context"]}
    if args.compare_stock:
        result["stock"] = _bench_stock(engine, instructions, args)
        result["ttfp_speedup"] = round(result["stock"]["ttfp_ms"]["p50"] / result["ttfp_ms"]["p50"], 1)
    return result


async def _caller(session, args: argparse.Namespace, width: int, height: int, index: int) -> dict[str, Any]:
    """One caller's turns: audio (and camera) pushed in 20 ms pieces as the call server does, then the answer."""
    ttfp, ttft, frame_ms, answer_ms, busy_s, audio_s = [], [], [], [], 0.0, 0.0
    token_ms, grammar_ms, calls = [], [], []
    clock = 0.0  # the session's media clock
    for turn in range(args.turns):
        if args.tools == "named":
            session.update(tools=ToolSet(BENCH_TOOLS, BENCH_TOOLS[(index + turn) % len(BENCH_TOOLS)].name))
        audio = _caller_turn(args.turn_s, seed=turn + 100 * index)
        frames = _camera(args.video_s + args.turn_s, width, height, clock, seed=turn) if args.video_s else []
        question_at = clock + args.video_s
        for start in range(0, len(audio), 320):
            now = question_at + start / INPUT_SAMPLE_RATE
            while frames and frames[0][0] <= now:
                await session.push_image(frames[0][1], frames[0][0])
                frames.pop(0)
            await session.push_audio(audio[start:start + 320], at=now)
        await _hang_over(session, args.silence_ms, question_at + args.turn_s)
        clock = question_at + args.turn_s + 30.0
        turn_started = time.perf_counter()
        made = 0
        async for event in session.respond():
            if isinstance(event, SpeechFrame):
                made += 1
            elif isinstance(event, ToolCallDone):
                calls.append(event)
            elif isinstance(event, ResponseDone):
                if event.metrics["tokens"] > 1 and not made:  # written: the time of each token after the first
                    m = event.metrics
                    token_ms.append((m["total_ms"] - m["ttft_ms"]) / (m["tokens"] - 1))
                    grammar_ms += [m["grammar_ms"] / m["tokens"]] if "grammar_ms" in m else []
                ttfp += [event.metrics["ttfp_ms"]] if "ttfp_ms" in event.metrics else []  # none: text only
                answer_ms.append(event.metrics["total_ms"])
                ttft += [event.metrics["ttft_ms"]] if "ttft_ms" in event.metrics else []  # none: no text
                frame_ms += [event.metrics["frame_ms_p50"]] if "frame_ms_p50" in event.metrics else []
        busy_s += time.perf_counter() - turn_started
        audio_s += made * FRAME_S
        if not args.json:
            print(f"session {index} turn {turn}: ttft {ttft[-1] if ttft else 0:.1f} ms, ttfp "
                  f"{ttfp[-1] if made else 0:.1f} ms, {made} frames, whole answer {answer_ms[-1]:.1f} ms", flush=True)
    return {"ttfp": ttfp, "ttft": ttft, "frame_ms": frame_ms, "answer_ms": answer_ms, "busy_s": busy_s,
            "audio_s": audio_s, "token_ms": token_ms, "grammar_ms": grammar_ms, "calls": calls}


async def _hang_over(session, silence_ms: int, at: float) -> None:
    """The silence a call server hears before it ends the turn, as it goes: pushed up to the pause at which the
    server has the answer prepared, then waited for in real time (the server holds that silence back)."""
    for piece in range(0, min(silence_ms, PREPARE_AFTER_SILENCE_MS), 20):
        await session.push_audio(np.zeros(320, dtype=np.float32), at=at + piece / 1000)
    if silence_ms > PREPARE_AFTER_SILENCE_MS:
        prepared = asyncio.ensure_future(session.prepare_answer())
        await asyncio.sleep((silence_ms - PREPARE_AFTER_SILENCE_MS) / 1000)
        await prepared


def _stage_times(engine: Engine, contexts: list, repeats: int = 20) -> dict[str, float]:
    """Median cost of each stage of one steady-state frame for the sessions' rows as one batch (what a frame of
    that many answers at once costs), host synchronisation included."""
    pool, talker = engine.pool, engine.pool.talker
    rows = rows_for(max(c.slot.index for c in contexts), len(pool))
    options = contexts[0].options
    codes = torch.zeros(rows, engine.model.config.talker_config.num_code_groups, dtype=torch.long,
                        device=engine.device)
    text = engine.talker_inputs.tts["pad"].expand(rows, 1, -1).contiguous()
    slots = {c.slot.index: c for c in contexts}
    thinker_rows = [(slots[r].slot, 0, slots[r].generator) if r in slots else None for r in range(rows)]
    stepping = [r if r in slots else None for r in range(rows)]
    befores = [pool.code2wav.context if r in slots else None for r in range(rows)]  # (past an answer's first frames)
    noise = torch.zeros(rows, talker.vocab, device=engine.device)
    residual = torch.zeros(rows, (talker.config.num_code_groups - 1) * talker.residual_vocab, device=engine.device)
    streams = [c.code2wav for c in contexts]

    def code2wav_frame() -> None:
        pool.code2wav.push(befores, codes).cpu()
        for stream in streams:
            stream.cache.crop(stream.cache.length - 1)

    def token_in_call(calls: dict[int, AnswerCalls]) -> None:
        """A Thinker token for every row, each row inside a function call: its mask computed during the step,
        the drawn token taken into its call (a new call once one ends), as an answer's calls go."""
        pool.start_tokens(thinker_rows, [options.thinker_sampling] * rows, overlap=False,
                          constraints={r: c.constraint() for r, c in calls.items()})
        for row, token in enumerate(pool.tokens()):
            if row in calls and token == engine.ids.im_end:
                calls[row] = AnswerCalls(engine.tool_runtime, calls[row].tools, 1 << 30, lambda event: None)
            elif row in calls:
                calls[row].take(token)

    def token_in_lock(locks: dict[int, Any]) -> None:
        """A Thinker token for every row under the language lock: its mask computed during the step, the drawn
        token taken into its text's grammar (a fresh one at the answer's end)."""
        pool.start_tokens(thinker_rows, [options.thinker_sampling] * rows, overlap=False, constraints=locks)
        for row, token in enumerate(pool.tokens()):
            if row in locks and token == engine.ids.im_end:
                locks[row] = engine.tool_runtime.text_matcher(options.language, calls=False)
            elif row in locks and not locks[row].consume_token(token):
                raise RuntimeError(f"a token outside the language lock was drawn: {locks[row].get_error()}")

    stages = {
        "thinker_token": lambda: (pool.start_tokens(thinker_rows, [options.thinker_sampling] * rows, overlap=False),
                                  pool.tokens()),
        "talker_step": lambda: (talker.step(stepping, codes, text, options.talker_sampling, noise),
                                talker.code0_values()),
        "code_predictor_15": lambda: talker.frame_codes(rows, options.predictor_sampling, residual).tolist(),
        "code2wav_frame": code2wav_frame,
    }
    lengths = [(c.cache.length, c.talker.cache.length) for c in contexts]
    for stream in streams:  # a full upsampler context before each timed frame
        stream.reset()
        for _ in range(stream.context):
            stream.push(codes[0])
    result = {name: _median_ms(engine, stage, repeats) for name, stage in stages.items()}
    if engine.tool_runtime is not None:  # (over more tokens: a call's first few are forced, their masks cheap)
        calls = {r: AnswerCalls(engine.tool_runtime, ToolSet(BENCH_TOOLS, "required"), 1 << 30, lambda event: None)
                 for r in slots}
        result["thinker_token_in_call"] = _median_ms(engine, lambda: token_in_call(calls), 5 * repeats)
    if options.language is not None:
        locks = {r: engine.tool_runtime.text_matcher(options.language, calls=False) for r in slots}
        result["thinker_token_language"] = _median_ms(engine, lambda: token_in_lock(locks), 5 * repeats)
    for context, (thinker_length, talker_length) in zip(contexts, lengths):
        context.cache.crop(thinker_length)
        context.talker.cache.crop(talker_length)
        context.code2wav.reset()
    return result


def _encoder_times(engine: Engine, repeats: int = 20) -> dict[str, float]:
    """Median cost of one pass of the audio encoder over a 1 s chunk from each of 1 and 8 callers (a prefill
    chunk), host work included: the engine's fixed-shape steps against the library's encoder."""
    mel = engine.log_mel(_caller_turn(0.99, seed=0))
    tower = engine.model.thinker.model.audio_tower
    result = {}
    for callers in (1, 8):
        features = [mel] * callers
        result[f"{callers}_engine"] = _median_ms(engine, lambda: engine.audio_encoder(features), repeats)
        result[f"{callers}_library"] = _median_ms(engine, lambda: audio_input.encode(tower, features), repeats)
    return result


def _median_ms(engine: Engine, fn, repeats: int) -> float:
    """Median wall time of `fn()`, the device's queued work included."""
    times = []
    for _ in range(repeats):
        _sync(engine)
        began = time.perf_counter()
        fn()
        _sync(engine)
        times.append((time.perf_counter() - began) * 1e3)
    return round(float(np.median(times)), 2)


def _bench_stock(engine: Engine, instructions: str, args) -> dict[str, Any]:
    """Stock generate on the first turn of the benchmark: its first audio comes when the whole answer is done."""
    ids = engine.ids
    audio = _caller_turn(args.turn_s, seed=0)
    mel = audio_input.log_mel(engine.feature_extractor, audio)
    prompt = [ids.im_start, ids.system, ids.newline, *engine.tokenizer.encode(instructions, add_special_tokens=False),
              ids.im_end, ids.newline, ids.im_start, ids.user, ids.newline, ids.audio_start,
              *[ids.audio] * audio_input.token_count(mel.shape[1]),
              ids.audio_end, ids.im_end, ids.newline, ids.im_start, ids.assistant, ids.newline]
    device = engine.device
    inputs = {"input_ids": torch.tensor([prompt], device=device),
              "input_features": mel[None].to(device, engine.dtype),
              "feature_attention_mask": torch.ones(1, mel.shape[1], dtype=torch.long, device=device)}
    totals, frames = [], 0
    for _ in range(args.stock_runs + 1):  # the first run warms up and is not counted
        _sync(engine)
        began = time.perf_counter()
        with torch.inference_mode(), moe.library_path(engine.model), attention.library_attention(engine.model), \
                norm.library_norm(engine.model):
            _, wav = engine.model.generate(**inputs, return_audio=True, thinker_max_new_tokens=args.answer_tokens,
                                           talker_max_new_tokens=args.answer_frames + 1, thinker_do_sample=True)
        _sync(engine)
        totals.append((time.perf_counter() - began) * 1e3)
        frames = round(wav.shape[-1] / (FRAME_S * 24_000))
    totals = totals[1:]
    return {"ttfp_ms": _percentiles(totals), "frame_ms": _percentiles([t / max(frames, 1) for t in totals]),
            "rtf": round(float(np.mean(totals)) / 1e3 / (frames * FRAME_S), 3) if frames else None,
            "frames": frames, "gpu_peak_gb": _round(engine.gpu_peak_gb())}


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _device_name(engine: Engine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"cpu ({engine.options.cpu_threads} engine threads)"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def main() -> int:
    parser = argparse.ArgumentParser(prog="rtc-agent bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
