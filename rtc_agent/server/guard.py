"""What every API request passes before its handler: the Origin allow-list (with CORS for allowed origins), the
bearer token, and, for handlers that read a body, its media type, size and read time. Every failure, and any
exception a handler lets out, becomes the contract's JSON error (errors.ApiError). The front of the process split
(front.py) runs the same guard before it reads a body, so both layouts refuse the same input the same way."""
from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Awaitable, Callable

from aiohttp import web
from yarl import URL

from ..config import Settings
from .errors import UNREADABLE_BODY, ApiError, unreadable_body

log = logging.getLogger(__name__)
API_PREFIXES = ("/api/",)  # paths guarded here; another API mounted elsewhere adds its prefix
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE_S = 600
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SETTINGS = web.AppKey("rtc_agent_settings", Settings)  # what the guard checks against (set by create_app, the front)


def bearer(header: str) -> str:
    """The credentials of an `Authorization: Bearer <credentials>` header, '' for another scheme or none; the
    scheme in any case (RFC 7235: `bearer` is `Bearer`)."""
    scheme, _, credentials = header.partition(" ")
    return credentials.lstrip(" ") if scheme.lower() == "bearer" else ""


def check_token(request: web.Request, token: str | None) -> None:
    """Constant-time bearer check. A header that is not latin-1 text cannot hold the token: it is just wrong."""
    if not token or request.method == "OPTIONS":
        return
    given = bearer(request.headers.get("Authorization", ""))
    try:
        given_bytes = given.encode("utf-8")
    except UnicodeEncodeError:  # aiohttp keeps undecodable header bytes as lone surrogates
        given_bytes = b""
    if not hmac.compare_digest(given_bytes, token.encode("utf-8")):
        raise ApiError(401, "unauthorized", "this server needs 'Authorization: Bearer <token>'",
                       {"WWW-Authenticate": "Bearer"})


def cross_origin(request: web.Request, allowed: tuple[str, ...]) -> str | None:
    """The request's Origin when it is an allowed cross-origin one (it gets CORS headers), None for a same-origin
    request or one without Origin (curl, the CLI client); ApiError 403 for any other origin. Same origin means
    the Origin's host[:port] is the Host the request was sent to (the scheme is left out: behind a TLS proxy
    the server itself speaks HTTP)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    try:
        same = URL(origin).raw_authority.lower() == request.host.lower()
    except ValueError:
        same = False
    if same:
        return None
    if origin in allowed or "*" in allowed:
        return origin
    raise ApiError(403, "origin_not_allowed", f"pages from {origin[:100]!r} may not use this server "
                   "(--allowed-origin adds an origin)")


def _cors(origin: str, response: web.StreamResponse) -> None:
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Vary"] = "Origin"
    response.headers["Access-Control-Expose-Headers"] = "Location, Retry-After"


@web.middleware
async def api_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith(API_PREFIXES):
        return await handler(request)
    settings = request.app[SETTINGS]
    origin: str | None = None
    try:
        origin = cross_origin(request, settings.allowed_origins)
        if request.method == "OPTIONS" and origin is not None:  # a CORS preflight from an allowed origin
            response: web.StreamResponse = web.Response(status=204, headers={
                "Access-Control-Allow-Methods": CORS_METHODS, "Access-Control-Allow-Headers": CORS_HEADERS,
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S)})
        else:
            check_token(request, settings.token)
            response = await handler(request)
    except ApiError as exc:
        response = exc.response()
    except web.HTTPRequestEntityTooLarge:
        response = ApiError(413, "body_too_large", "the request body is too large").response()
    except UNREADABLE_BODY:
        response = unreadable_body().response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = ApiError(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason).response()
    except Exception:  # a bug, not bad input: still the contract's JSON, and the call slots stay as they were
        log.exception("%s %s failed", request.method, request.path)
        response = ApiError(500, "internal_error", "the server failed to handle this request").response()
    if origin is not None:
        _cors(origin, response)
    return response


async def read_body(request: web.Request, content_types: tuple[str, ...]) -> bytes:
    """The request body, if it is one of `content_types`, within the size limit, and read within the request
    timeout (a client trickling its body a byte at a time must not hold the handler)."""
    settings = request.app[SETTINGS]
    if request.content_type not in content_types:
        raise ApiError(415, "unsupported_media_type", f"the body must be {' or '.join(content_types)}")
    limit = settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "body_too_large", f"the body may be at most {limit} bytes")
    try:
        return await asyncio.wait_for(request.read(), settings.request_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, "request_timeout", f"the body did not arrive within {settings.request_timeout_s:g} s"
                       ) from None
