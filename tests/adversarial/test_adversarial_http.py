"""Bad HTTP input against a real server (tiny model): each gets its status and JSON error code, never a 500 nor a
logged traceback, holds no call slot, and a normal call on the same server still gets its spoken answer afterwards.
test_adversarial_split.py sends the same input to the front of the process split."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import aiohttp
import pytest

from adversary import active_calls, error_code, mangle, post_offer, still_answers
from rtc_support import audio_offer, needs_espeak, run, server, wait_ready
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)

pytestmark = [needs_espeak, pytest.mark.timeout(240)]


def sdp_cases(good: str) -> list[tuple[str, str, str]]:
    """(what, mangled offer, expected code): every SDP row of issue 13 and the ones that passed before."""
    mid = good.split("a=mid:")[1].split("\r\n")[0]  # the audio line's
    return [
        ("BUNDLE names a missing mid", mangle(good, r"a=group:BUNDLE (.*)", r"a=group:BUNDLE \1 9"), "invalid_sdp"),
        ("a renamed mid", mangle(good, rf"a=mid:{mid}", "a=mid:renamed"), "invalid_sdp"),
        ("a NUL in a mid", mangle(good, rf"a=mid:{mid}", f"a=mid:{mid}\x00x"), "invalid_sdp"),
        ("no ice-ufrag", mangle(good, r"a=ice-ufrag:.*", None), "invalid_sdp"),
        ("no ice-pwd", mangle(good, r"a=ice-pwd:.*", None), "invalid_sdp"),
        ("no fingerprint", mangle(good, r"a=fingerprint:.*", None), "invalid_sdp"),
        ("no common codec", mangle(good, r"a=rtpmap:(\d+) opus/48000/2", r"a=rtpmap:\1 speex/48000"), "invalid_sdp"),
        ("RTP/AVP", mangle(good, r"m=audio (\d+) UDP/TLS/RTP/SAVPF (.*)", r"m=audio \1 RTP/AVP \2"), "invalid_sdp"),
        ("port 0 audio", mangle(good, r"m=audio \d+ (.*)", r"m=audio 0 \1"), "no_audio"),
        ("audio recvonly (no microphone)", mangle(good, r"a=sendrecv", "a=recvonly", 1), "no_audio"),
        ("audio inactive", mangle(good, r"a=sendrecv", "a=inactive", 1), "no_audio"),
        ("a text m-line", good + "m=text 9 UDP/TLS/RTP/SAVPF 98\r\na=mid:t\r\n", "invalid_sdp"),
        ("garbage lines", "v=0\r\nthis is not sdp\r\n", "invalid_sdp"),
        ("a malformed m-line", "v=0\r\nm=audio x UDP/TLS/RTP/SAVPF 111\r\n", "invalid_sdp"),
        ("no audio line", "v=0\r\ns=-\r\n", "no_audio"),
        ("a lone surrogate", good + "a=x:\ud800\r\n", "invalid_sdp"),
    ]


def two_hundred_audio_lines(good: str) -> str:
    """The audio section repeated 200 times, each with its own mid (all named in BUNDLE)."""
    head, rest = good.split("m=audio", 1)
    audio, tail = ("m=audio" + rest).split("m=application", 1)
    mid = audio.split("a=mid:")[1].split("\r\n")[0]
    copies = [audio.replace(f"a=mid:{mid}\r\n", f"a=mid:a{i}\r\n") for i in range(200)]
    head = head.replace(f"a=group:BUNDLE {mid}", "a=group:BUNDLE " + " ".join(f"a{i}" for i in range(200)))
    return head + "".join(copies) + "m=application" + tail


def offer_cases(good: str) -> list[tuple[str, Any, bytes | None, int, str]]:
    """(what, JSON body, or raw bytes sent as application/json, expected status, expected code): every bad body,
    then every bad SDP of `sdp_cases`."""
    return [
        ("not JSON", None, b"{not json", 400, "invalid_json"),
        ("JSON nested 100 000 deep", None, b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
        ("objects nested 40 000 deep", None, b"{\"a\":" * 40_000 + b"1" + b"}" * 40_000, 400, "invalid_json"),
        ("NaN in the body", None, b'{"sdp": NaN, "type": "offer"}', 400, "invalid_json"),
        ("not UTF-8", None, b'{"sdp": "\xff\xfe", "type": "offer"}', 400, "invalid_json"),
        ("a JSON array", [1, 2], None, 400, "invalid_json"),
        ("no sdp", {"type": "offer"}, None, 400, "invalid_value"),
        ("an answer", {"sdp": good, "type": "answer"}, None, 400, "invalid_value"),
        ("an unknown voice", {"sdp": good, "type": "offer", "voice": "bob"}, None, 400, "invalid_value"),
        ("instructions not text", {"sdp": good, "type": "offer", "instructions": 42}, None, 400,
         "invalid_value"),
        ("instructions with a lone surrogate", None,
         json.dumps({"sdp": good, "type": "offer", "instructions": "hi \ud800"}).encode(), 400,
         "invalid_value"),
        ("300 KiB", None, b"x" * (300 * 1024), 413, "body_too_large"),
        ("200 audio m-lines", {"sdp": two_hundred_audio_lines(good), "type": "offer"}, None, 400,
         "invalid_sdp"),
    ] + [(what, {"sdp": sdp, "type": "offer"}, None, 400, code) for what, sdp, code in sdp_cases(good)]


async def refused_as_listed(url: str, good: str, headers: dict[str, str] | None = None) -> None:
    """Every case of `offer_cases` gets its status and code."""
    for what, body, raw, status, code in offer_cases(good):
        assert await error_code(url, body, raw=raw, headers=headers) == (status, code), what


def test_bad_offer_bodies_and_sdp_get_their_400_and_leave_nothing_behind() -> None:
    async def main() -> None:
        async with server() as (url, app):
            await wait_ready(url)
            good = await audio_offer()
            threads = threading.active_count()
            await refused_as_listed(url, good)
            assert active_calls(app) == 0
            assert threading.active_count() <= threads + 2  # (the asyncio executor may add a worker)
            await still_answers(url, app)

    run(main(), timeout_s=200)


def test_content_type_and_origin_are_checked() -> None:
    async def main() -> None:
        async with server(allowed_origins=("https://app.example",)) as (url, app):
            await wait_ready(url)
            body = json.dumps({"sdp": await audio_offer(), "type": "offer"}).encode()
            host = url.split("//")[1]
            # a cross-origin "simple" request (text/plain needs no preflight) is refused before it takes a slot
            text = {"Content-Type": "text/plain"}
            assert await error_code(url, raw=body, headers=text) == (415, "unsupported_media_type")
            assert await error_code(url, raw=body, headers={"Content-Type": "application/x-www-form-urlencoded",
                                                            "Origin": "https://evil.example"}
                                    ) == (403, "origin_not_allowed")
            assert await error_code(url, raw=body, headers={"Origin": "null"}) == (403, "origin_not_allowed")
            async with aiohttp.ClientSession() as http:
                preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
                async with http.options(f"{url}/api/offer", headers=preflight) as r:
                    assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
                preflight["Origin"] = "https://app.example"
                async with http.options(f"{url}/api/offer", headers=preflight) as r:
                    assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
                    assert "Content-Type" in r.headers["Access-Control-Allow-Headers"]
            # the listed origin and the server's own pages (same host) get their answer; then hang up
            for origin in ("https://app.example", f"http://{host}"):
                status, data, headers = await post_offer(url, raw=body, headers={"Origin": origin})
                assert status == 200, data
                cors = headers.get("Access-Control-Allow-Origin")
                assert cors == (origin if origin == "https://app.example" else None)
                async with aiohttp.ClientSession() as http:
                    async with http.delete(f"{url}/api/sessions/{data['session_id']}",
                                           headers={"Origin": origin}) as r:
                        assert r.status == 200
            assert active_calls(app) == 0
            await still_answers(url, app)

    run(main(), timeout_s=200)


async def raw_answer(url: str, request: bytes) -> tuple[int, Any]:
    """Sends `request` as it is (bytes no HTTP client would write); returns the answer's status and its JSON body
    (None when it is not JSON)."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)).lower()
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head else 0
        body = await asyncio.wait_for(reader.readexactly(length), 10.0)
    finally:
        writer.close()
    json_body = b"content-type: application/json" in head
    return int(head.split()[1]), json.loads(body) if json_body else None


def request_with(authorization: bytes, method: bytes = b"GET", path: bytes = b"/api/config", body: bytes = b"",
                 headers: bytes = b"Content-Type: application/json\r\n") -> bytes:
    return (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " +
            authorization + b"\r\n" + headers + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def check_authorization_headers(url: str, token: str, body: bytes) -> None:
    """Tokens that are not latin-1 or not UTF-8 get 401; a control byte in the header (which aiohttp refuses
    before the server sees the request) gets the JSON 400 `bad_request`; the scheme in any case is taken."""
    for given in ("\u00e9t\u00e9".encode(), "\u4f60\u597d".encode(), b"\xff\xfe\x80", token.encode() + b"\xff",
                  b"\x80"):
        for method, path, payload in ((b"POST", b"/api/offer", body), (b"GET", b"/api/config", b"")):
            status, data = await raw_answer(url, request_with(b"Bearer " + given, method, path, payload))
            assert (status, data["error"]["code"]) == (401, "unauthorized"), (given, path)
    for control in (b"\x01", b"\x7f", b"\x00"):
        status, data = await raw_answer(url, request_with(b"Bearer " + token[:3].encode() + control + b"x"))
        assert (status, data["error"]["code"]) == (400, "bad_request"), control
        assert "not valid HTTP" in data["error"]["message"] and "Bearer" not in data["error"]["message"]
    for scheme in (b"bearer", b"BEARER", b"beArer"):
        status, data = await raw_answer(url, request_with(scheme + b" " + token.encode()))
        assert status == 200 and data["token_required"], scheme
    assert await error_code(url, json.loads(body), headers={"Authorization": "Bearer wrong"}) == (401, "unauthorized")


async def check_unreadable_bodies(url: str, token: str) -> None:
    """Bodies aiohttp cannot read (a gzip body that is not gzip, a multipart part that is not one), and a
    WebSocket upgrade without its key, get the JSON 400 `bad_request`."""
    auth = b"Bearer " + token.encode()
    for path, headers, body in (
            (b"/api/offer", b"Content-Type: application/json\r\nContent-Encoding: gzip\r\n", b"not gzip"),
            (b"/v1/realtime/calls", b"Content-Type: multipart/form-data; boundary=xx\r\n", b"--xx\r\ngarbage")):
        status, data = await raw_answer(url, request_with(auth, b"POST", path, body, headers))
        assert (status, data["error"]["code"]) == (400, "bad_request"), path
    upgrade = (b"GET /v1/realtime?model=tiny HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth +
               b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\r\n")
    status, data = await raw_answer(url, upgrade)
    assert (status, data["error"]["code"]) == (400, "bad_request")


def test_bad_authorization_headers_and_unreadable_bodies_get_json_errors_and_no_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with server(token="s3cret") as (url, app):
            await wait_ready(url)
            body = json.dumps({"sdp": await audio_offer(), "type": "offer"}).encode()
            await check_authorization_headers(url, "s3cret", body)
            await check_unreadable_bodies(url, "s3cret")
            assert active_calls(app) == 0
            status, data, _ = await post_offer(url, json.loads(body), headers={"Authorization": "bearer s3cret"})
            assert status == 200 and data["session_id"]

    run(main(), timeout_s=120)
    assert not [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
