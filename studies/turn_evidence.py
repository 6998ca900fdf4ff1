#!/usr/bin/env python3
"""Does the audio's own evidence (studies/turn_features.py) beside Smart Turn's score end finished turns
sooner without cutting more mid-sentence pauses? Fitted on training score files, reported on held-out ones.

    .venv/bin/python -m studies.turn_tuning --set tuning --out espeak-tuning.json    # and flite voices, heldout, real
    .venv/bin/python -m studies.turn_tuning --set tuning --kinds statements --out espeak-tuning-statements.json
    .venv/bin/python -m studies.turn_evidence --train espeak-tuning.json+espeak-tuning-statements.json ... \
        --eval espeak-heldout.json flite-slt-heldout.json ... real.json [--floor 0.9] [--cv] [--separation]

A policy asks for Smart Turn's verdict at 64, 128 and 192 ms of silence (as `auto` does), then every `gap_ms`
until `cap_ms`, where the turn ends anyway. At each check a logistic model of the check's features (below) gives
P(this silence is the turn's end); the turn ends at the first check where it is >= the policy's threshold. The
"auto then" policies keep auto's own early checks and let the model decide from 256 ms of silence on. The
model's weights are fitted on the training files' checks (final silences against mid-sentence pauses, each
silence weighing the same); the schedule and threshold are the fastest (finished P50 + P90) that keep
--floor of the training pauses. Nothing is chosen on the --eval files.

Feature sets compared: the early verdicts and the silence alone (the wait follows how sure the first verdicts
were), Smart Turn re-scored as the silence grows (its latest score, its first one, the silence), then that plus
each piece of evidence on its own, then all of them, and all but the utterance's length.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from studies.turn_tuning import FINISHED, VERDICT_MS, verdicts
from rtc_agent.media.end_of_turn import EAGERNESS
from rtc_agent.media.vad import CHUNK_MS

SMART_TURN = ("logit_p", "logit_p_first", "silence_s")
EVIDENCE = ("tail_db", "fall_db", "pitch_end_st", "pitch_slope_st_s", "speech_s")
CAPS_MS = (1400, 2000)  # auto with a shorter cap, reported beside it
EARLY_MS = 256  # auto's early checks are before this
# the checks between 192 ms and the cap: one every 64 ms would cost a verdict's 45 ms of CPU every 64 ms of every
# silence, most of a core per caller
GAPS_MS = (128, 192, 256)
WAIT = ("logit_p_early", "silence_s")
# name: (features, auto's early checks first)
FEATURE_SETS = {"early verdicts set the wait": (WAIT, False), "smart turn re-scored": (SMART_TURN, False),
                **{f"+ {e}": (SMART_TURN + (e,), False) for e in EVIDENCE},
                "+ all evidence": (SMART_TURN + EVIDENCE, False),
                "+ all evidence but length": (SMART_TURN + EVIDENCE[:-1], False),
                "auto then early verdicts set the wait": (WAIT, True),
                "auto then smart turn re-scored": (SMART_TURN, True),
                "auto then + all evidence but length": (SMART_TURN + EVIDENCE[:-1], True),
                "auto then + all evidence": (SMART_TURN + EVIDENCE, True)}


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return float(np.log(p / (1 - p)))


def features(asked: list[float], silence_ms: int, heard: dict[str, float] | None) -> dict[str, float]:
    """The features of a check: Smart Turn's verdicts of this silence so far (`asked`, the latest last), the
    silence, and the silence's evidence (None: too little speech; then each piece is its training mean)."""
    out = {"logit_p": _logit(asked[-1]), "logit_p_first": _logit(asked[0]),
           "logit_p_early": _logit(float(np.mean(asked[:3]))), "silence_s": silence_ms / 1000}
    if heard is not None:
        out.update({k: v for k, v in heard.items() if k != "speech_ms"}, speech_s=heard["speech_ms"] / 1000)
    return out


@dataclasses.dataclass(frozen=True)
class Logistic:
    names: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray
    weights: np.ndarray  # bias first, then one per name (on standardized features)

    def __call__(self, f: dict[str, float]) -> float:
        x = np.array([f.get(n, m) for n, m in zip(self.names, self.mean)])
        z = self.weights[0] + self.weights[1:] @ ((x - self.mean) / self.std)
        return float(1 / (1 + np.exp(-z)))

    def describe(self) -> str:
        return ", ".join(f"{n} {w:+.2f}" for n, w in zip(("bias",) + self.names, self.weights))


def fit(x: np.ndarray, y: np.ndarray, w: np.ndarray, names: tuple[str, ...], l2: float = 1.0) -> Logistic:
    """Weighted L2-regularised logistic regression by Newton's method."""
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-9
    a = np.hstack([np.ones((len(x), 1)), (x - mean) / std])
    beta = np.zeros(a.shape[1])
    ridge = np.diag([0.0] + [l2] * (a.shape[1] - 1))
    for _ in range(50):
        p = 1 / (1 + np.exp(-a @ beta))
        grad = a.T @ (w * (p - y)) + ridge @ beta
        hess = (a * (w * p * (1 - p))[:, None]).T @ a + ridge
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.abs(step).max() < 1e-8:
            break
    return Logistic(names, mean, std, beta)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A check schedule with a logistic verdict; `given(heard)` binds it to one silence's evidence for
    turn_tuning's replay (which asks for first_check_ms, next_check_ms, ends_turn and max_wait_ms)."""

    model: Logistic
    threshold: float
    gap_ms: int
    cap_ms: int
    after_auto: bool = False  # the early checks (before 256 ms) are auto's; the model decides from 256 ms on
    first_check_ms: int = 64
    heard: dict[str, float] | None = None

    @property
    def max_wait_ms(self) -> int:
        return self.cap_ms

    def next_check_ms(self, point_ms: int) -> int:
        return point_ms + (64 if point_ms + 64 < EARLY_MS else self.gap_ms)

    def ends_turn(self, asked: list[float], silence_ms: int) -> bool:
        if self.after_auto and silence_ms < EARLY_MS:
            return EAGERNESS["auto"].ends_turn(asked, silence_ms)
        return self.model(features(asked, silence_ms, self.heard)) >= self.threshold

    def given(self, heard: dict[str, float] | None) -> Policy:
        return dataclasses.replace(self, heard=heard)

    def describe(self) -> str:
        early = "auto's checks" if self.after_auto else "checks 64/128/192"
        return f"{early}, then every {self.gap_ms} ms, cap {self.cap_ms} ms, end at q >= {self.threshold}"


def silences(rows: list[dict[str, Any]]) -> list[tuple[list[float], dict[str, float] | None, bool, int]]:
    """(scores, evidence, is the final silence, how long it lasts in ms) for every silence of every sentence."""
    out = []
    for r in rows:
        out += [(m, e, False, len(m) * CHUNK_MS) for m, e in zip(r["mid"], r["mid_evidence"])]
        if r["final"] and r["kind"] in FINISHED:
            out.append((r["final"], r["final_evidence"], True, 10_000))
    return out


def check_rows(rows: list[dict[str, Any]], gap_ms: int, cap_ms: int, names: tuple[str, ...], after_auto: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every check the schedule makes in every silence (one verdict at a time, VERDICT_MS each, as the replay):
    features, label (final silence), weight (each silence weighs 1 in all). `after_auto`: only the checks from
    256 ms on of silences that auto's early checks did not end."""
    schedule = Policy(None, 1.0, gap_ms, cap_ms)  # type: ignore[arg-type]
    auto = EAGERNESS["auto"]
    xs, ys, ws = [], [], []
    for scores, heard, final, longest in silences(rows):
        point, ends_at, asked, mine = schedule.first_check_ms, 0, [], []
        for i, p in enumerate(scores):
            silence = (i + 1) * CHUNK_MS
            if silence >= cap_ms or silence + VERDICT_MS >= longest:
                break
            if silence >= max(point, ends_at):
                ends_at, point = silence + VERDICT_MS, schedule.next_check_ms(point)
                asked.append(p)
                if not after_auto or silence >= EARLY_MS:
                    mine.append(features(asked, silence, heard))
                elif auto.ends_turn(asked, silence):
                    break
        xs += mine
        ys += [final] * len(mine)
        ws += [1 / len(mine)] * len(mine) if mine else []
    means = {n: np.mean([f[n] for f in xs if n in f]) for n in names}
    x = np.array([[f.get(n, means[n]) for n in names] for f in xs])
    return x, np.array(ys, float), np.array(ws)


def replay(rows: list[dict[str, Any]], policy: Any) -> dict[str, Any]:
    """turn_tuning.evaluate for any policy (an Eagerness, or a Policy bound to each silence's own evidence):
    finished speech end -> verdict P50 / P90, finished sentences cut in a short pause, paused sentences kept,
    and the verdicts a finished turn asks for (its CPU)."""
    def bound(heard: dict[str, float] | None) -> Any:
        return policy.given(heard) if isinstance(policy, Policy) else policy

    waits, finished_cut, kept, paused, counts, unfinished = [], 0, 0, 0, [], []
    for r in rows:
        if r["kind"] == "unfinished":  # real speech: a clause the sentence goes on after; how long it waits
            unfinished.append(verdicts(r["final"], bound(r["final_evidence"]), 10_000)[0] or policy.max_wait_ms)
        cut = any(verdicts(m, bound(e), len(m) * CHUNK_MS)[0] is not None for m, e in zip(r["mid"], r["mid_evidence"]))
        if r["kind"] == "paused":
            paused, kept = paused + 1, kept + (not cut)
        if r["kind"] in FINISHED:
            finished_cut += cut
            wait = verdicts(r["final"], bound(r["final_evidence"]), 10_000)[0] or policy.max_wait_ms
            waits.append(r["vad_tail_ms"] + wait)
            counts.append(len(check_times(policy, wait)))
    return {"p50": float(np.percentile(waits, 50)), "p90": float(np.percentile(waits, 90)),
            "finished_cut": finished_cut, "kept": kept, "paused": paused,
            "kept_share": kept / paused if paused else 1.0, "verdicts": float(np.mean(counts)),
            "unfinished": unfinished}


def check_times(policy: Any, ended_ms: int) -> list[int]:
    """The check points a turn asked Smart Turn at before it ended at `ended_ms` of silence (a verdict's CPU
    each); a Policy that does not look at the latest verdict needs none after the early ones."""
    points, point = [], policy.first_check_ms
    rescores = not isinstance(policy, Policy) or "logit_p" in policy.model.names
    last = ended_ms if rescores else min(ended_ms, EARLY_MS)
    while point + VERDICT_MS <= last:
        points.append(point)
        point = policy.next_check_ms(point)
    return points


def choose(train: list[dict[str, Any]], feature_set: tuple[tuple[str, ...], bool], floor: float,
           p50_ms: float = 10_000) -> tuple[Policy, dict[str, Any]] | None:
    """The fastest policy (finished P50 + P90) keeping `floor` of the training pauses with a P50 of at most
    `p50_ms`, fitted on `train`."""
    best: tuple[float, Policy, dict[str, Any]] | None = None
    names, after_auto = feature_set
    for gap_ms, cap_ms in itertools.product(GAPS_MS, (1100, 1400, 1700, 2000, 3000)):
        model = fit(*check_rows(train, gap_ms, cap_ms, names, after_auto), names)
        for threshold in np.round(np.arange(0.30, 0.99, 0.02), 2):
            policy = Policy(model, float(threshold), gap_ms, cap_ms, after_auto)
            r = replay(train, policy)
            if r["kept_share"] >= floor and r["p50"] <= p50_ms and (best is None or r["p50"] + r["p90"] < best[0]):
                best = (r["p50"] + r["p90"], policy, r)
    return None if best is None else (best[1], best[2])


def load(paths: list[str]) -> list[dict[str, Any]]:
    """The rows of turn_tuning.py --out files; "a.json+b.json" is one file of both (statements with their set's
    paused sentences, say)."""
    return [r for p in paths for part in p.split("+") for r in json.loads(Path(part).read_text())]


def name_of(path: str) -> str:
    return "+".join(Path(p).stem for p in path.split("+"))


def row(r: dict[str, Any]) -> str:
    return (f"{r['p50']:.0f} / {r['p90']:.0f} ms, kept {r['kept']}/{r['paused']}, finished cut {r['finished_cut']},"
            f" {r['verdicts']:.1f} verdicts" + (f", unfinished wait {r['unfinished']} ms" if r["unfinished"] else ""))


def separation(paths: list[str]) -> None:
    """Smart Turn's score at 64 and 192 ms of silence and each piece of evidence on its own: the chance that a
    finished sentence's final silence has a higher value than a mid-sentence pause of >= 400 ms (0.5: no
    separation; below 0.5: the other way round), per file."""
    columns = {"P at 64 ms": lambda scores, e: scores[1], "P at 192 ms": lambda scores, e: scores[5],
               **{n: (lambda scores, e, k="speech_ms" if n == "speech_s" else n: e[k]) for n in EVIDENCE}}
    print("| file (finished / pauses) | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for f in paths:
        rows = load([f])
        mid = [(m, e) for r in rows if r["kind"] == "paused" for m, e in zip(r["mid"], r["mid_evidence"])
               if e and len(m) * CHUNK_MS >= 400]
        for kind in sorted({r["kind"] for r in rows} & set(FINISHED)):  # one line per kind of finished sentence
            final = [(r["final"], r["final_evidence"]) for r in rows if r["kind"] == kind and r["final_evidence"]]
            cells = []
            for value in columns.values():
                a, b = np.array([value(*x) for x in final])[:, None], np.array([value(*x) for x in mid])[None]
                cells.append(f"{((a > b) + 0.5 * (a == b)).mean():.2f}")
            print(f"| {name_of(f)}: {kind} ({len(final)} / {len(mid)}) | " + " | ".join(cells) + " |")


def cross_validate(paths: list[str], names: list[str], floor: float, p50_ms: float) -> None:
    """Each training file held out in turn, the policy chosen on the others: how a feature set carries over to a
    voice it was not fitted on, without looking at the held-out sets."""
    print("| policy | " + " | ".join(name_of(f) for f in paths) + " | mean P50 / P90, kept |")
    print("|---" * (len(paths) + 2) + "|")
    for name in ["auto", *names]:
        results = []
        for f in paths:
            rows = load([f])
            chosen = (EAGERNESS["auto"], None) if name == "auto" else choose(
                load([g for g in paths if g != f]), FEATURE_SETS[name], floor, p50_ms)
            if chosen is None:
                break
            results.append(replay(rows, chosen[0]))
        if len(results) < len(paths):
            print(f"| {name} | none meets the constraints on the other files |")
            continue
        mean = {k: np.mean([r[k] for r in results]) for k in ("p50", "p90", "kept_share")}
        print(f"| {name} | " + " | ".join(row(r) for r in results)
              + f" | {mean['p50']:.0f} / {mean['p90']:.0f} ms, {mean['kept_share']:.0%} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", nargs="+", required=True, help="turn_tuning.py --out files to fit and choose on")
    p.add_argument("--eval", nargs="+", default=[], help="held-out files to report on (one column each)")
    p.add_argument("--floor", type=float, default=0.9, help="share of training pauses kept, at least")
    p.add_argument("--sets", default=",".join(FEATURE_SETS), help="feature sets to compare (comma-separated)")
    p.add_argument("--p50", type=float, default=10_000, help="finished P50 on the training files, at most (ms)")
    p.add_argument("--cv", action="store_true", help="only leave-one-file-out on the training files (a voice each)")
    p.add_argument("--separation", action="store_true", help="only each piece of evidence's separation, per file")
    args = p.parse_args()
    if args.separation:
        separation(args.train + args.eval)
        return
    if args.cv:
        cross_validate(args.train, args.sets.split(","), args.floor, args.p50)
        return
    train = load(args.train)
    evals = {name_of(f): load([f]) for f in args.eval}
    print(f"| policy | train ({len(args.train)} files) | " + " | ".join(evals) + " |")
    print("|---" * (2 + len(evals)) + "|")
    for cap_ms in (3000, *CAPS_MS):
        e = dataclasses.replace(EAGERNESS["auto"], max_wait_ms=cap_ms)
        print(f"| auto{'' if cap_ms == 3000 else f' ending at {cap_ms} ms (not chosen: a sensitivity)'} | "
              + " | ".join(row(replay(rows, e)) for rows in [train, *evals.values()]) + " |")
    for name in args.sets.split(","):
        chosen = choose(train, FEATURE_SETS[name], args.floor, args.p50)
        if chosen is None:
            print(f"| {name}: none meets the constraints on the training files |")
            continue
        policy, r = chosen
        print(f"| {name}: {policy.describe()} | {row(r)} | "
              + " | ".join(row(replay(rows, policy)) for rows in evals.values()) + " |")
        print(f"|   weights: {policy.model.describe()} |")


if __name__ == "__main__":
    main()
