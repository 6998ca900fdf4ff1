"""Time-limited TURN credentials (the TURN REST scheme that coturn's `use-auth-secret` checks).

The username is `<expiry unix time>:<user>`, the password base64(HMAC-SHA1(secret, username)). coturn recomputes
the password from the shared secret and refuses the username once its time has passed, so a caller gets access
for `turn_ttl_s` and the secret itself never leaves the server.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from typing import Any

from ..config import Settings


def turn_credentials(secret: str, ttl_s: int, user: str, now: float | None = None) -> tuple[str, str]:
    """(username, password) valid until now + ttl_s."""
    expiry = int(now if now is not None else time.time()) + ttl_s
    username = f"{expiry}:{user}"
    digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode()


def turn_ice_servers(settings: Settings) -> list[dict[str, Any]]:
    """The TURN entry of /api/config's ice_servers, with fresh credentials for one caller (none configured: [])."""
    if not settings.turn_urls or not settings.turn_secret:
        return []
    username, credential = turn_credentials(settings.turn_secret, settings.turn_ttl_s,
                                            "caller-" + secrets.token_hex(4))
    return [{"urls": list(settings.turn_urls), "username": username, "credential": credential}]
