"""What the adversarial tests share: raw requests against a real server, a real aiortc offer to mangle, and the
check that ends every test: a normal caller on the same server still gets its spoken answer."""
from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
from aiohttp import web

from rtc_agent.server.state import STATE
from rtc_support import caller, say


async def post_offer(url: str, body: Any = None, *, raw: bytes | str | None = None,
                     headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    """POSTs to /api/offer (JSON `body`, or `raw` bytes sent as application/json unless `headers` say
    otherwise); returns the status, the JSON answer (None when the body is not JSON) and the headers."""
    headers = dict(headers or {})
    kwargs: dict[str, Any] = {"json": body}
    if raw is not None:
        headers.setdefault("Content-Type", "application/json")
        kwargs = {"data": raw}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/api/offer", headers=headers, **kwargs) as r:
            text = await r.text()
            data = await r.json(content_type=None) if r.content_type == "application/json" else None
            assert r.content_type == "application/json" or not text, (r.status, text[:200])
            return r.status, data, dict(r.headers)


async def error_code(url: str, body: Any = None, **kwargs: Any) -> tuple[int, str]:
    status, data, _ = await post_offer(url, body, **kwargs)
    return status, data["error"]["code"] if data and "error" in data else ""


def mangle(sdp: str, pattern: str, replacement: str | None, count: int = 0) -> str:
    """`sdp` with the lines that fully match `pattern` rewritten (None: removed), the first `count` (0: all)."""
    lines, done = [], 0
    for line in sdp.split("\r\n"):
        if re.fullmatch(pattern, line) and (count == 0 or done < count):
            done += 1
            if replacement is None:
                continue
            line = re.sub(pattern, replacement, line)
        lines.append(line)
    assert done, f"{pattern!r} is not in the offer"
    return "\r\n".join(lines)


def active_calls(app: web.Application) -> int:
    return len(app[STATE].sessions)


async def still_answers(url: str, app: web.Application) -> None:
    """A normal call on the same server connects and gets a spoken answer; nothing is left over afterwards."""
    async with caller(url) as (call, mic):
        await say(call, mic, "Hello, how are you?")
        done = (await call.next_event("response.done", timeout_s=30))["response"]
        assert done["status"] == "incomplete" and done["metrics"]["frames_sent"] > 0
        assert not call.events_of("error")
    for _ in range(50):  # the hang-up (DELETE) frees the call at once
        if active_calls(app) == 0:
            return
        await asyncio.sleep(0.1)
    assert active_calls(app) == 0
