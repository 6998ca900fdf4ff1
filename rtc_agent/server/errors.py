"""The two ways a client's bad input is refused: an HTTP error (ApiError) or a contract error code
(ProtocolError, which becomes an HTTP 400 or an `error` event on the data channel)."""
from __future__ import annotations

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

# A body aiohttp cannot read: a bad Content-Encoding, a broken chunk, a malformed multipart part
UNREADABLE_BODY = (RequestPayloadError, HttpProcessingError)


class ProtocolError(Exception):
    """Bad input from a client: becomes an HTTP 400 or an `error` event; nothing else changes."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param  # the field at fault, where one is (the Realtime API's errors name it)


class ApiError(Exception):
    """An HTTP answer with the contract's JSON error body `{"error": {"code", "message"}}`."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}
        self.reason = reason  # server_full: "slots" (every call slot taken) or "memory" (the memory guard)

    def response(self) -> web.Response:
        body = {"error": {"code": self.code, "message": self.message,
                          **({"reason": self.reason} if self.reason else {})}}
        return web.json_response(body, status=self.status, headers=self.headers)


def unreadable_body() -> ApiError:
    """The 400 for a body aiohttp could not read (UNREADABLE_BODY)."""
    return ApiError(400, "bad_request", "the request body cannot be read (a malformed Content-Encoding, chunk or "
                    "multipart part)")
