"""The model side of rtc-agent: Qwen3-Omni's Thinker, Talker and Code2Wav, streamed (see engine.py)."""
from .context import TurnTooLongError
from .engine import PREPARE_AFTER_SILENCE_MS, Engine, EngineFullError, Session
from .events import FRAME_SAMPLES, INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE, ResponseDone, SpeechFrame, TextDelta
from .kv_cache import ContextFullError
from .loader import ModelLoadError
from .memory import EngineOutOfMemory, MemoryUse
from .options import VOICES, EngineOptions, SessionOptions
from .sampling import Sampling

__all__ = ["ContextFullError", "Engine", "PREPARE_AFTER_SILENCE_MS", "EngineFullError", "EngineOptions", "EngineOutOfMemory", "FRAME_SAMPLES", "INPUT_SAMPLE_RATE", "MemoryUse",
           "ModelLoadError", "OUTPUT_SAMPLE_RATE", "ResponseDone", "Sampling", "Session", "SessionOptions", "SpeechFrame", "TextDelta",
           "TurnTooLongError", "VOICES"]
