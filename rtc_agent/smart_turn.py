"""The Smart Turn v3.2 model file and what its input is, shared by the two places that run it: the media
processes' scorer (media/end_of_turn.py, onnxruntime on the CPU) and the engine's (engine/step/turn_scoring.py,
the same graph as torch ops on the engine's device).

The file ships in the `pipecat-ai` wheel (BSD-2) and is found by path, without importing pipecat. The model sees
the turn's last WINDOW_S at 16 kHz, zero-padded at the front as it was trained.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

RATE = 16_000
WINDOW_S = 8  # the model sees the last 8 s of the turn
MODEL_FILE = ("audio", "turn", "smart_turn", "data", "smart-turn-v3.2-cpu.onnx")  # inside the pipecat package
INSTALL_HINT = "pip install pipecat-ai==1.14.0 (a dependency of rtc-agent: its wheel carries the file)"


class EndOfTurnUnavailable(RuntimeError):
    """The Smart Turn model file (from the pipecat-ai wheel) is not installed."""


def model_path() -> Path:
    """The ONNX file inside the installed pipecat package, found without importing pipecat."""
    spec = importlib.util.find_spec("pipecat")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*MODEL_FILE)
        if path.is_file():
            return path
    raise EndOfTurnUnavailable(f"semantic_vad needs the Smart Turn v3.2 model: {INSTALL_HINT}")


def model_installed() -> bool:
    try:
        model_path()
    except EndOfTurnUnavailable:
        return False
    return True


def windows(turns: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """The model's view of each turn: its last WINDOW_S, zero-padded at the front as the model was trained
    [turns, RATE x WINDOW_S]; written into the first rows of `out` where given (its other rows are left as they
    are)."""
    window = RATE * WINDOW_S
    if out is None:
        batch = np.zeros((len(turns), window), np.float32)
    else:
        batch = out[:len(turns)]
        batch.fill(0.0)
    for row, audio in zip(batch, turns):
        audio = np.asarray(audio, np.float32)[-window:]
        row[window - len(audio):] = audio
    return batch
