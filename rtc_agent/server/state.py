"""What the request handlers share: settings, metrics, the calls, and the engine once it is loaded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..config import Settings
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

    @property
    def ready(self) -> bool:
        return self.engine is not None and bool(getattr(self.engine, "ready", False))

    @property
    def can_take_call(self) -> bool:
        return self.ready and not self.draining and self.sessions.free > 0


STATE = web.AppKey("rtc_agent_state", ServerState)
