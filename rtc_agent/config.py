"""One settings object for the server: defaults < config file (TOML) < environment (RTC_AGENT_*) < flags."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import language as languages
from .package_data import WEB_DIR

VOICES = ("chelsie", "ethan", "aiden")
VISION_BLOCK = 32  # the vision encoder's patch (16 px) times its spatial merge (2): one Thinker token per block
MAX_VIDEO_SIDE = 1280
MAX_VIDEO_FPS = 10.0
TURN_DETECTIONS = ("server_vad", "semantic_vad")  # the Realtime API's names
EAGERNESS_LEVELS = ("low", "medium", "high", "auto")  # semantic_vad: how soon a turn may end (media/end_of_turn.py)
DEFAULT_INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly and in a friendly, spoken style."


@dataclass(frozen=True)
class TurnSettings:
    """How the server decides that the caller's turn started, ended, or interrupts the answer."""

    vad_threshold: float = 0.5  # silero speech probability that counts as speech
    silence_ms: int = 400  # hang-over: this much silence after speech ends the turn (docs/turn-taking.md says why 400)
    prefix_padding_ms: int = 300  # audio kept from before the detected speech start
    min_speech_ms: int = 128  # shorter speech is a false start (cough, click): dropped, no turn
    barge_in_ms: int = 256  # caller speech this long during an answer interrupts it
    auto: bool = True  # False: push-to-talk, only input_audio_buffer.commit ends a turn
    turn_detection: str = "semantic_vad"  # server_vad: silence_ms ends a turn; semantic_vad: the end-of-turn model
    # (build_settings: server_vad when none is asked for and the model is not installed)
    eagerness: str = "auto"  # semantic_vad: low | medium | high | auto (docs/turn-taking.md)


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    cert: str | None = None  # TLS certificate (PEM)
    key: str | None = None  # TLS private key (PEM)
    self_signed: bool = False  # make a self-signed certificate (phones on a LAN need HTTPS)
    token: str | None = None  # when set, /api/* needs "Authorization: Bearer <token>"
    allowed_origins: tuple[str, ...] = ()  # pages from these origins may call /api/* ("*": any); same-origin always
    max_sessions: int = 0  # concurrent calls = engine session slots; 0: as many as fit in GPU memory (4 on a CPU)
    ice_servers: tuple[str, ...] = ()  # stun:host:port, turn:user:pass@host:port?transport=udp
    ice_host_addresses: tuple[str, ...] = ()  # host candidate addresses; empty: all but loopback (aioice)
    turn_urls: tuple[str, ...] = ()  # turn:host:port?transport=udp; callers get time-limited credentials for them
    turn_secret: str | None = None  # coturn's static-auth-secret (TURN REST scheme); never leaves the server
    turn_ttl_s: int = 3600  # how long the TURN credentials handed to a caller stay valid
    resume_window_s: float = 30.0  # a call whose connection died waits this long for its caller to resume it
    drain_timeout_s: float = 300.0  # on SIGTERM: no new calls, wait this long at most for calls to end
    model: str = "tiny"
    device: str = "auto"
    quantize: str = "none"  # none | int4 | auto: INT4 weights (docs/memory.md, "INT4 weights")
    voice: str = "ethan"
    instructions: str = DEFAULT_INSTRUCTIONS
    language: str | None = None  # the language lock of every call (language.py); None: none
    max_answer_s: float = 30.0  # an answer's speech stops after this long (the random-weight tiny model never ends)
    turn: TurnSettings = field(default_factory=TurnSettings)
    peer_timeout_s: float = 5.0  # no inbound audio this long: the peer is gone, the call is ended
    video_fps: float = 2.0  # caller video frames per second handed to the model (docs/api.md, "Video")
    video_max_side: int = 384  # frames are scaled to fit in this square, sides multiples of 32 (docs/api.md, "Video")
    video_window_s: int = 30  # seconds of caller video the model keeps in its context; 0: video is ignored
    no_talker: bool = False  # text-only agent: neither the Talker nor Code2Wav is loaded; answers are text
    no_audio_stream: bool = False  # an answer's audio goes out only once all of it is made (then paced)
    memory_guard_pct: float = 90.0  # GPU memory use above this: no new calls, shorter video windows
    gpu_memory_fraction: float = 1.0  # cap this process's share of the GPU's memory (torch), before the weights
    idle_timeout_s: float = 300.0  # a call with no caller speech and no answer this long is ended; 0: never
    max_call_s: float = 3600.0  # a call is ended after this long; 0: no limit
    max_body_bytes: int = 256 * 1024
    request_timeout_s: float = 15.0  # a request's headers, and its body, must arrive within this; idle keep-alive
    max_connections: int = 512  # open HTTP connections; more are closed as they are accepted
    media_processes: int = -1  # processes for the calls' media beside the engine's; 0: one process; -1: auto
    end_of_turn_on: str = "auto"  # media: Smart Turn on each media process's CPU; engine: on the engine's device,
    # every call's verdicts batched; overflow: media, a process's decisions beyond one at a time on the engine;
    # auto: overflow on a GPU, else media (docs/turn-taking.md, "Where the verdicts run")
    last_words: bool = False  # semantic_vad also hears the turn's last words (docs/turn-taking.md; off: why there)
    # captions of the caller's words on the page's calls (/api/offer): on, off, or auto (on where the speech
    # recogniser is installed; build_settings decides); /v1 calls follow their session's transcription setting
    transcription: str = "auto"
    web_dir: str = str(WEB_DIR)
    log_level: str = "INFO"
    # not a setting: build_settings says here why turn.turn_detection is server_vad when none was asked for (the
    # end-of-turn model of the default, semantic_vad, is not installed); the log, /api/config and session.created
    # repeat it
    turn_detection_note: str | None = None
    # not a setting: why transcription is off when it was not asked for by name (the recogniser is not installed)
    transcription_note: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if (self.cert or self.self_signed) else "http"


_TURN_FIELDS = {f.name: f for f in dataclasses.fields(TurnSettings)}
_FIELDS = {f.name: f for f in dataclasses.fields(Settings)
           if f.name not in ("turn", "turn_detection_note", "transcription_note")}


def _convert(value: Any, default: Any, name: str) -> Any:
    """Turns a string (env, flag) or TOML value into the type of the field's default."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if isinstance(default, tuple):
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(str(v) for v in value)
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return None if value is None else str(value)


def _load_file(path: str) -> dict[str, Any]:
    import tomllib

    with open(path, "rb") as f:
        return tomllib.load(f)


def build_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Settings:
    """Merges the sources; a flag left as None does not override. Turn settings are flat: silence_ms etc."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    config_file = config_file or env.get("RTC_AGENT_CONFIG")
    if config_file:
        data = _load_file(config_file)
        values.update({k: v for k, v in data.items() if k != "turn"})
        values.update(data.get("turn", {}))
    for name in (*_FIELDS, *_TURN_FIELDS):
        key = "RTC_AGENT_" + name.upper()
        if key in env:
            values[name] = env[key]
    values.update({k: v for k, v in (flags or {}).items() if v is not None})

    unknown = set(values) - set(_FIELDS) - set(_TURN_FIELDS)
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    top = {k: _convert(v, _FIELDS[k].default, k) for k, v in values.items() if k in _FIELDS}
    turn = {k: _convert(v, _TURN_FIELDS[k].default, k) for k, v in values.items() if k in _TURN_FIELDS}
    settings = Settings(**top, turn=TurnSettings(**turn))
    validate(settings)
    settings = settings if "turn_detection" in turn else _installed_turn_detection(settings)
    return _installed_transcription(settings)


def _installed_transcription(settings: Settings) -> Settings:
    """transcription auto: on where the speech recogniser is installed, else off with a note saying why (on asked
    for by name without it: validate refuses)."""
    if settings.transcription != "auto":
        return settings
    from .media import moonshine

    if moonshine.installed():
        return dataclasses.replace(settings, transcription="on")
    note = f"transcription: off, because the speech recogniser is not installed; {moonshine.INSTALL_HINT}"
    return dataclasses.replace(settings, transcription="off", transcription_note=note)


def _installed_turn_detection(settings: Settings) -> Settings:
    """The default turn detection, semantic_vad, where its end-of-turn model is installed; else server_vad, with
    a note saying why. (semantic_vad asked for by name is kept: the server then refuses to start, with the
    install hint.)"""
    from .smart_turn import INSTALL_HINT, model_installed

    if model_installed():
        return settings
    note = (f"turn detection: server_vad, not the default semantic_vad, because the end-of-turn model is not "
            f"installed; {INSTALL_HINT}")
    return dataclasses.replace(settings, turn=dataclasses.replace(settings.turn, turn_detection="server_vad"),
                               turn_detection_note=note)


QUANTIZE_CHOICES = ("none", "int4", "auto")
END_OF_TURN_CHOICES = ("auto", "media", "overflow", "engine")  # (engine/options.py's, without importing torch)
TRANSCRIPTION_CHOICES = ("on", "off", "auto")


def validate(s: Settings) -> None:
    if s.quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, not {s.quantize!r}")
    if s.voice not in VOICES:
        raise ValueError(f"voice must be one of {', '.join(VOICES)}")
    languages.check(s.language)
    if bool(s.cert) != bool(s.key):
        raise ValueError("--cert and --key go together")
    if s.last_words:
        from .media import last_words

        if not last_words.installed():
            raise ValueError(f"--last-words needs its models: {last_words.INSTALL_HINT}")
    if s.transcription not in TRANSCRIPTION_CHOICES:
        raise ValueError(f"transcription must be one of {', '.join(TRANSCRIPTION_CHOICES)}, not {s.transcription!r}")
    if s.transcription == "on":
        from .media import moonshine

        if not moonshine.installed():
            raise ValueError(f"--transcription on needs the speech recogniser: {moonshine.INSTALL_HINT}")
    if s.end_of_turn_on not in END_OF_TURN_CHOICES:
        raise ValueError(f"end_of_turn_on must be one of {', '.join(END_OF_TURN_CHOICES)}, not {s.end_of_turn_on!r}")
    if not 0.08 <= s.max_answer_s <= 600:
        raise ValueError("max_answer_s must be between 0.08 and 600")
    if s.max_sessions < 0:
        raise ValueError("max_sessions must be at least 1, or 0 for as many as fit")
    if not 0.1 <= s.video_fps <= MAX_VIDEO_FPS:
        raise ValueError(f"video_fps must be between 0.1 and {MAX_VIDEO_FPS:g}")
    if not (VISION_BLOCK <= s.video_max_side <= MAX_VIDEO_SIDE and s.video_max_side % VISION_BLOCK == 0):
        raise ValueError(f"video_max_side must be a multiple of {VISION_BLOCK} between {VISION_BLOCK} and "
                         f"{MAX_VIDEO_SIDE} (the vision encoder works in {VISION_BLOCK} px blocks)")
    if bool(s.turn_urls) != bool(s.turn_secret):
        raise ValueError("--turn-url and --turn-secret go together")
    for url in s.turn_urls:
        if not url.startswith(("turn:", "turns:")) or "@" in url:
            raise ValueError(f"--turn-url takes turn:host:port[?transport=udp|tcp] (no credentials), got {url!r}")
    if not 60 <= s.turn_ttl_s <= 86400:
        raise ValueError("turn_ttl_s must be between 60 and 86400 seconds")
    if not 0 <= s.resume_window_s <= 600:
        raise ValueError("resume_window_s must be between 0 (no resuming) and 600 seconds")
    if not 0 <= s.drain_timeout_s <= 3600:
        raise ValueError("drain_timeout_s must be between 0 and 3600 seconds")
    if s.idle_timeout_s < 0 or s.max_call_s < 0:
        raise ValueError("idle_timeout_s and max_call_s must be 0 (off) or a number of seconds")
    if not 0.1 <= s.request_timeout_s <= 600:
        raise ValueError("request_timeout_s must be between 0.1 and 600")
    if not -1 <= s.media_processes <= 64:
        raise ValueError("media_processes must be -1 (auto), 0 (one process for everything) or up to 64")
    if s.max_connections < 8:
        raise ValueError("max_connections must be at least 8")
    if not 0 <= s.video_window_s <= 600:
        raise ValueError("video_window_s must be between 0 (video ignored) and 600 seconds")
    if not 10 <= s.memory_guard_pct <= 100:
        raise ValueError("memory_guard_pct must be between 10 and 100 (100: the guard is off)")
    if not 0.05 <= s.gpu_memory_fraction <= 1:
        raise ValueError("gpu_memory_fraction must be between 0.05 and 1")
    t = s.turn
    if not 0.0 < t.vad_threshold < 1.0:
        raise ValueError("vad_threshold must be between 0 and 1")
    for name in ("silence_ms", "min_speech_ms", "barge_in_ms", "prefix_padding_ms"):
        if not 0 <= getattr(t, name) <= 10_000:
            raise ValueError(f"{name} must be between 0 and 10000")
    if t.turn_detection not in TURN_DETECTIONS:
        raise ValueError(f"turn_detection must be one of {', '.join(TURN_DETECTIONS)}")
    if t.eagerness not in EAGERNESS_LEVELS:
        raise ValueError(f"eagerness must be one of {', '.join(EAGERNESS_LEVELS)}")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `rtc-agent serve`. Every flag defaults to None so that env and file values show through."""
    d = Settings()
    t = d.turn
    p.add_argument("--config", help="TOML settings file (same names as the flags, [turn] table allowed)")
    p.add_argument("--host", help=f"address to listen on (default {d.host}; 0.0.0.0 for a LAN)")
    p.add_argument("--port", type=int, help=f"port (default {d.port})")
    p.add_argument("--cert", help="TLS certificate, PEM")
    p.add_argument("--key", help="TLS private key, PEM")
    p.add_argument("--self-signed", action="store_true", default=None,
                   help="serve HTTPS with a generated self-signed certificate (phones on a LAN)")
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on /api/* (the page takes ?token=)")
    p.add_argument("--allowed-origin", dest="allowed_origins", action="append",
                   help="let pages from this origin (https://app.example.com, or *) call the API; repeatable "
                        "(default: same-origin pages only)")
    p.add_argument("--idle-timeout-s", type=float,
                   help="end a call after this long without caller speech or an answer "
                        f"(default {d.idle_timeout_s:g}; 0: never)")
    p.add_argument("--max-call-s", type=float, help=f"end a call after this long (default {d.max_call_s:g}; 0: never)")
    p.add_argument("--request-timeout-s", type=float,
                   help=f"seconds for a request's headers, and for its body (default {d.request_timeout_s:g})")
    p.add_argument("--max-connections", type=int,
                   help=f"open HTTP connections; more are closed at once (default {d.max_connections})")
    p.add_argument("--max-sessions", type=int, help="concurrent calls, each a session slot made at start-up (default: "
                   "as many as fit in GPU memory after the weights, at most 24; 4 on a CPU); more get 503")
    p.add_argument("--ice-server", dest="ice_servers", action="append",
                   help="STUN/TURN server, repeatable: stun:host:port or turn:user:pass@host:port?transport=udp")
    p.add_argument("--ice-host-address", dest="ice_host_addresses", action="append",
                   help="use only these addresses for host ICE candidates (e.g. 127.0.0.1 for loopback tests)")
    p.add_argument("--turn-url", dest="turn_urls", action="append",
                   help="TURN server handed to callers with credentials that expire, repeatable: "
                        "turn:host:3478?transport=udp (needs --turn-secret)")
    p.add_argument("--turn-secret", help="the TURN server's static-auth-secret (coturn use-auth-secret)")
    p.add_argument("--turn-ttl-s", type=int, help=f"lifetime of a caller's TURN credentials (default {d.turn_ttl_s})")
    p.add_argument("--resume-window-s", type=float,
                   help=f"seconds a call whose connection died waits to be resumed (default {d.resume_window_s:g})")
    p.add_argument("--drain-timeout-s", type=float,
                   help=f"on SIGTERM, seconds to let calls finish before stopping (default {d.drain_timeout_s:g})")
    p.add_argument("--model", help=f"engine model (default {d.model}: the built-in tiny model)")
    p.add_argument("--device", help=f"cpu, cuda, cuda:N or auto (default {d.device})")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                   help=f"INT4 weights for the experts and attention: int4, auto (int4 where bf16 would pass 90 %% "
                        f"of the GPU with the slots asked for) or none (default {d.quantize})")
    p.add_argument("--voice", choices=VOICES, help=f"default voice (default {d.voice})")
    p.add_argument("--instructions", help="default system prompt")
    p.add_argument("--language", choices=list(languages.LANGUAGES),
                   help="lock the answers' text to this language's scripts (default: no lock; README: Settings)")
    p.add_argument("--max-answer-s", type=float, help=f"longest spoken answer in seconds (default {d.max_answer_s})")
    p.add_argument("--vad-threshold", type=float, help=f"speech probability threshold (default {t.vad_threshold})")
    p.add_argument("--turn-detection", choices=TURN_DETECTIONS,
                   help=f"server_vad: a fixed silence ends a turn; semantic_vad: the end-of-turn model decides "
                        f"(default {t.turn_detection}; server_vad where that model is not installed)")
    p.add_argument("--eagerness", choices=EAGERNESS_LEVELS,
                   help=f"semantic_vad: how soon a turn may end (default {t.eagerness})")
    p.add_argument("--silence-ms", type=int, help=f"server_vad: silence that ends a turn (default {t.silence_ms})")
    p.add_argument("--prefix-padding-ms", type=int, help=f"audio kept before speech start ({t.prefix_padding_ms})")
    p.add_argument("--min-speech-ms", type=int, help=f"shorter speech is ignored (default {t.min_speech_ms})")
    p.add_argument("--barge-in-ms", type=int, help=f"caller speech that interrupts an answer ({t.barge_in_ms})")
    p.add_argument("--peer-timeout-s", type=float,
                   help=f"end a call after this long without audio ({d.peer_timeout_s})")
    p.add_argument("--video-fps", type=float,
                   help=f"caller video frames per second given to the model (default {d.video_fps:g})")
    p.add_argument("--video-max-side", type=int,
                   help=f"scale video frames to fit in this many pixels, a multiple of 32 (default {d.video_max_side})")
    p.add_argument("--video-window-s", type=int,
                   help=f"seconds of caller video kept in the model's context (default {d.video_window_s}; 0: none)")
    p.add_argument("--no-talker", action="store_true", default=None,
                   help="text-only agent: load neither the Talker nor Code2Wav (8-10 GB less on the full model); "
                        "answers arrive as text on the data channel")
    p.add_argument("--no-audio-stream", action="store_true", default=None,
                   help="send an answer's audio only once all of it is made (then paced in real time)")
    p.add_argument("--memory-guard-pct", type=float,
                   help=f"above this %% of GPU memory in use, refuse new calls (503 server_full, reason memory) "
                        f"and shorten the video windows of calls (default {d.memory_guard_pct:g}; 100: off)")
    p.add_argument("--gpu-memory-fraction", type=float,
                   help="cap this process at this fraction of the GPU's memory, set before the weights load "
                        f"(default {d.gpu_memory_fraction:g}: no cap)")
    p.add_argument("--media-processes", type=int,
                   help="processes that run the calls' media (WebRTC, Opus, VAD, turn-taking), beside one for the "
                        "engine and the front on the port; 0: everything in one process; -1 (default): 0 on a CPU, "
                        "else one per core left, at most 8 (README: Processes)")
    p.add_argument("--end-of-turn-on", choices=END_OF_TURN_CHOICES,
                   help="where semantic_vad's end-of-turn model runs: media (onnxruntime on the CPU of each call's "
                        "process), engine (on the engine's GPU, every call's verdicts batched), overflow (media, "
                        "and a process's decisions asked for while one of its own runs, and that one too, on the "
                        "engine's GPU); auto (default): overflow on a GPU, else media (README: Turn-taking)")
    p.add_argument("--last-words", action="store_true", default=None,
                   help="semantic_vad also transcribes each pause's last words and asks a language model whether a "
                        "sentence can end there (pip install 'rtc-agent[last-words]'; off by default: README, "
                        "Turn-taking)")
    p.add_argument("--transcription", choices=("on", "off"),
                   help="live captions of the caller's words on the page's calls (input_audio_transcription events; "
                        "default: on where the speech recogniser is installed; /v1 calls follow their session's "
                        "audio.input.transcription)")
    p.add_argument("--web-dir", help="folder served at / (default: the page that ships with the package, web/)")
    p.add_argument("--log-level", help=f"DEBUG, INFO, WARNING (default {d.log_level})")


def settings_from_args(args: argparse.Namespace) -> Settings:
    flags = {k: v for k, v in vars(args).items() if k in _FIELDS or k in _TURN_FIELDS}
    return build_settings(flags, config_file=getattr(args, "config", None))
