"""studies/real_speech.py without the network: how clips are cut and that the manifest matches the clip list."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile

from studies import real_speech
from studies.real_speech import Clip, Part, cut

RATE = 8000


def _prompt(path: Path, lead_s: float, speech_s: float, tail_s: float) -> None:
    """A prompt as Asterisk's are: digital silence, a sound at about -20 dBFS, digital silence."""
    t = np.arange(int(speech_s * RATE)) / RATE
    tone = (0.1 * np.sin(2 * np.pi * 300 * t) * 32767).astype(np.int16)
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, np.concatenate([np.zeros(int(lead_s * RATE), np.int16), tone,
                                          np.zeros(int(tail_s * RATE), np.int16)]), RATE, subtype="PCM_16")


def test_a_composed_pause_is_exactly_its_length_and_the_end_is_the_last_sound(tmp_path: Path) -> None:
    _prompt(tmp_path / "src" / "pkg" / "a.wav", 0.1, 0.5, 0.3)
    _prompt(tmp_path / "src" / "pkg" / "b.wav", 0.2, 0.4, 0.25)
    c = cut(Clip("x", "paused", "v", "a <700 ms> b", [Part("pkg", "a.wav"), 700, Part("pkg", "b.wav")]),
            tmp_path)
    loud = np.flatnonzero(np.abs(c.samples) > 100)
    gaps = np.diff(loud)
    i = int(np.argmax(gaps))
    assert c.rate == RATE
    assert abs((gaps[i] - 1) - 0.7 * RATE) <= RATE // 100  # the prompts' own silences are gone
    (first, last), = c.pauses
    assert last - first + 1 == int(0.7 * RATE)
    assert loud[i] < first and last < loud[i + 1]
    assert abs(c.end - loud[-1]) <= RATE // 100
    assert len(c.samples) - c.end > 0.2 * RATE  # the last prompt keeps its own silence after the end
    assert set(c.sources) == {"pkg:a.wav", "pkg:b.wav"}


def test_a_cut_recording_fades_out_and_keeps_its_aligned_end(tmp_path: Path) -> None:
    _prompt(tmp_path / "src" / "pkg" / "a.wav", 0.0, 1.0, 0.0)
    c = cut(Clip("x", "finished", "v", "a", [Part("pkg", "a.wav", stop_ms=600, end_ms=550)]), tmp_path)
    assert len(c.samples) == int(0.6 * RATE)
    assert abs(int(c.samples[-1])) < 50
    assert c.end == int(0.55 * RATE) - 1


def test_the_manifest_lists_the_clips_of_the_script() -> None:
    manifest = json.loads(real_speech.MANIFEST.read_text())
    kinds = [c["kind"] for c in manifest["clips"].values()]
    assert (kinds.count("finished"), kinds.count("paused"), kinds.count("unfinished")) == (44, 19, 4)
    assert set(manifest["packages"]) == set(real_speech.PACKAGES)
    ids = [f"allison/{i}" for i in real_speech.ALLISON_FINISHED]
    ids += [f"allison/{p[0]}+" for p in real_speech.ALLISON_PAUSED]
    assert len(set(ids)) == len(ids) and set(ids) <= set(manifest["clips"])
    for clip in manifest["clips"].values():
        assert clip["end_ms"] < clip["duration_ms"]
        if clip["kind"] == "paused":
            assert clip["pauses_ms"] and all(b - a >= 600 for a, b in clip["pauses_ms"])
