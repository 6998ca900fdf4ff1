"""Settings of the engine (one per process) and of each session (voice, prompt, sampling)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import language as languages
from .step.sampling import Sampling
from .step.tools import ToolSet

VOICES = ("chelsie", "ethan", "aiden")
QUANTIZE_CHOICES = ("none", "int4", "auto")  # weight-only INT4 (int4.py): never, always, where bf16 would not fit
END_OF_TURN_CHOICES = ("auto", "media", "overflow", "engine")  # where Smart Turn runs (EngineOptions.end_of_turn)
DEFAULT_INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly, in a friendly spoken style."

# The release's sampling defaults: the Talker's come from `Qwen3OmniMoeForConditionalGeneration.generate`
# (top_k 50, top_p 1.0, temperature 0.9, repetition penalty 1.05) and its code predictor's (top_k 50, top_p 0.8).
THINKER_SAMPLING = Sampling(temperature=0.7, top_k=20, top_p=0.8)
TALKER_SAMPLING = Sampling(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
PREDICTOR_SAMPLING = Sampling(temperature=1.0, top_k=50, top_p=0.8)


@dataclass(frozen=True)
class EngineOptions:
    model: str = "tiny"  # tiny | synthetic:30b-a3b | path to a local checkpoint
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"  # none | int4 | auto: weight-only INT4 of the experts and attention (int4.py)
    text_only: bool = False  # no Talker or Code2Wav: not even loaded
    streaming: bool = True  # False: the whole answer is made, then its text and audio come out at once
    prefill_chunk_s: float = 1.0  # encode and prefill the caller's audio every this many seconds; 0: at turn end
    context_tokens: int = 8192  # Thinker KV cache per session; oldest turns are dropped beyond it
    max_answer_tokens: int = 256
    max_frames: int = 1024  # 82 s of speech
    max_sessions: int = 0  # session slots made at start-up; 0: as many as fit in GPU memory (4 on the CPU)
    cuda_graphs: bool = True  # decode steps as CUDA graphs (GPU only)
    # A prepared answer's first frame made in its preparation (CallContext.prepare_answer); None: on a GPU only. On
    # a 2-core CPU a frame of the tiny model takes 33-71 ms, near real time with an answer playing, and a pause the
    # caller talks through throws that frame away; on a GPU it is one batched step of the round's preparations.
    first_frame_in_preparation: bool | None = None
    video_window_s: int = 30  # seconds of caller video kept in the context (one grid of tokens each); 0: no video
    # a second of video this close to the last one kept (mean |diff|, 0-255) is left out
    video_still_threshold: float = 2.0
    fast_moe: bool = True  # MoE kernels, single-token in decode and grouped in prefill (CUDA with Triton only)
    fast_attention: bool = True  # one-position attention as matmuls for decode (attention.py; CUDA only)
    fast_norm: bool = True  # every RMSNorm as one fused kernel (norm.py; CUDA with Triton only)
    fast_rotary: bool = True  # q/k norm, rotary and cache write of graphed steps in one kernel (rotary.py)
    fast_sampling: bool = True  # the Talker's and code predictor's draws in one kernel (sampling.py; CUDA)
    overlap: bool = True  # the Thinker's next token on a side stream while a frame is made (CUDA graphs only)
    gpu_memory_fraction: float = 1.0  # the most of the GPU's memory this process may take (set before the weights)
    end_of_turn: str = "auto"  # where Smart Turn scores turns: media (each media process's CPU, onnxruntime) |
    # engine (this engine's device, every call's verdicts batched: turn_scoring.py) | overflow (media, and a
    # decision asked for while another of the same process is under way goes to the engine) | auto (overflow
    # on a GPU where the model file is installed, else media)
    cpu_threads: int = 1  # torch threads of the engine's worker for its CPU work (on a CPU the model: the tiny
    # model's small products run twice as fast on one thread as on two, 2-core machine: frame 33 vs 64 ms; on a GPU
    # the log-mel features and inputs); the media keep the other cores

    def __post_init__(self) -> None:
        if self.cpu_threads < 1:
            raise ValueError("cpu_threads must be at least 1")
        if self.prefill_chunk_s < 0 or (0 < self.prefill_chunk_s < 0.5):
            raise ValueError("prefill_chunk_s must be 0 (whole turn at its end) or at least 0.5 s")
        if self.context_tokens < 256 + self.max_answer_tokens:
            raise ValueError("context_tokens must be at least max_answer_tokens + 256 = "
                             f"{256 + self.max_answer_tokens}")
        if not 0 <= self.video_window_s <= 600:
            raise ValueError("video_window_s must be 0 (no video) to 600 seconds")
        if self.video_still_threshold < 0:
            raise ValueError("video_still_threshold must be >= 0 (0: keep every second of video)")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, not {self.quantize!r}")
        if self.end_of_turn not in END_OF_TURN_CHOICES:
            raise ValueError(f"end_of_turn must be one of {', '.join(END_OF_TURN_CHOICES)}, not {self.end_of_turn!r}")
        if self.max_sessions < 0:
            raise ValueError("max_sessions must be >= 0 (0: as many as fit)")
        if self.max_answer_tokens < 1 or self.max_frames < 1:
            raise ValueError("max_answer_tokens and max_frames must be >= 1")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError("gpu_memory_fraction must be above 0 and at most 1")


@dataclass(frozen=True)
class SessionOptions:
    voice: str = "ethan"
    instructions: str = DEFAULT_INSTRUCTIONS
    greedy: bool = False
    seed: int | None = None
    thinker_sampling: Sampling = THINKER_SAMPLING
    talker_sampling: Sampling = TALKER_SAMPLING
    predictor_sampling: Sampling = PREDICTOR_SAMPLING
    max_answer_tokens: int | None = None  # None: the engine's
    max_frames: int | None = None
    speech: bool = True  # False: answers are text only (the Talker sits them out); no effect on a text-only engine
    tools: ToolSet = ToolSet()  # functions the model may call (tools.py), listed in the system turn
    language: str | None = None  # the language lock (language.py): answers written in this language's scripts

    def __post_init__(self) -> None:
        if self.voice not in VOICES:
            raise ValueError(f"unknown voice {self.voice!r}: choose one of {', '.join(VOICES)}")
        if not isinstance(self.instructions, str) or len(self.instructions) > 20_000:
            raise ValueError("instructions must be a string of at most 20000 characters")
        if not isinstance(self.tools, ToolSet):
            raise ValueError("tools must be a ToolSet")
        languages.check(self.language)
        if self.greedy:  # greedy is greedy everywhere; the Talker keeps its repetition penalty, as stock does
            object.__setattr__(self, "thinker_sampling", replace(self.thinker_sampling, greedy=True))
            object.__setattr__(self, "talker_sampling", replace(self.talker_sampling, greedy=True))
            object.__setattr__(self, "predictor_sampling", replace(self.predictor_sampling, greedy=True))
