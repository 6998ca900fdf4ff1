"""What the request handlers share: settings, metrics, the calls, and the engine once it is loaded."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..config import Settings
from ..media.captions import CaptionPool
from ..media.end_of_turn import EndOfTurnScorer
from ..media.vad import VadPool
from .memory_guard import MemoryGuard
from .metrics import Metrics
from .sessions import Sessions


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    sessions: Sessions
    engine: Any = None  # rtc_agent.engine.Engine, once loaded
    load_error: str | None = None
    draining: bool = False  # SIGTERM: no new calls; the process ends when the last call has
    vads: VadPool = field(default_factory=VadPool)  # silero models, reused from call to call
    loaded: bool = False  # the start-up loader is done (models, call capacity, warm-up)
    guard: MemoryGuard | None = None  # GPU memory: gauges, and no new calls above --memory-guard-pct
    end_of_turn: EndOfTurnScorer | None = None  # the calls' end-of-turn scorer (app.end_of_turn_scorer), once loaded
    captions: CaptionPool | None = None  # the speech recogniser of the callers' captions, once loaded (None: off)
    captions_loading: asyncio.Task | None = None  # a media process's recogniser, loading since before its engine was up
    tag: str = ""  # a media process's mark on its call ids and tokens ("m2."), by which the front routes them

    @property
    def ready(self) -> bool:
        """Everything a call needs is loaded. (An engine handed in already warm is not enough: the capacity and
        the end-of-turn model are set by the loader.)"""
        return self.loaded and self.engine is not None and bool(getattr(self.engine, "ready", False))

    @property
    def engine_lost(self) -> str | None:
        """Why the engine is unreachable: an engine process that died (remote.RemoteEngine.lost); None otherwise."""
        return getattr(self.engine, "lost", None)

    @property
    def memory_full(self) -> bool:
        """GPU memory is above the guard's limit (as of its latest reading)."""
        return self.guard is not None and self.guard.over

    @property
    def can_take_call(self) -> bool:
        return self.ready and not self.draining and self.sessions.free > 0 and not self.memory_full


STATE = web.AppKey("rtc_agent_state", ServerState)
