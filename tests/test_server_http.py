"""The HTTP contract's answers and error paths, capacity, readiness, and cleanup of a vanished peer."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import ssl
import wave

import aiohttp
import numpy as np
import pytest
from aiortc import RTCPeerConnection

from rtc_agent.client.peer import CallError
from rtc_agent.server import tls
from rtc_agent.server.state import STATE
from rtc_support import restore_ice  # noqa: F401  (autouse fixture)
from rtc_support import (LOOPBACK, audio_offer, caller, metric, metrics_text, needs_espeak, run, server, settings,
                         speech, wait_ready)

pytestmark = pytest.mark.timeout(180)


async def post(url: str, body: Any = None, *, raw: bytes | None = None, token: str | None = None
               ) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
    async with aiohttp.ClientSession() as http:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with http.post(f"{url}/api/offer", headers=headers, **kwargs) as r:
            return r.status, await r.json(content_type=None), dict(r.headers)


def test_bad_offers_get_400_with_a_json_error_and_the_server_keeps_working() -> None:
    async def main() -> None:
        async with server() as (url, _):
            await wait_ready(url)
            good = await audio_offer()
            cases = [
                (None, b"{not json", "invalid_json"),
                ([1, 2], None, "invalid_json"),
                ({"type": "offer"}, None, "invalid_value"),
                ({"sdp": good, "type": "answer"}, None, "invalid_value"),
                ({"sdp": good, "type": "offer", "voice": "bob"}, None, "invalid_value"),
                ({"sdp": good, "type": "offer", "instructions": 42}, None, "invalid_value"),
                ({"sdp": good, "type": "offer", "language": "xx"}, None, "invalid_value"),
                ({"sdp": "v=0\r\nm=audio x UDP/TLS/RTP/SAVPF 111\r\n", "type": "offer"}, None, "invalid_sdp"),
                ({"sdp": "v=0\r\nthis is not sdp\r\n", "type": "offer"}, None, "invalid_sdp"),
            ]
            for body, raw, code in cases:
                status, data, _ = await post(url, body, raw=raw)
                assert (status, data["error"]["code"]) == (400, code), (body, raw)
                assert data["error"]["message"]

            pc = RTCPeerConnection()  # a data channel and no microphone
            pc.createDataChannel("events")
            await pc.setLocalDescription(await pc.createOffer())
            status, data, _ = await post(url, {"sdp": pc.localDescription.sdp, "type": "offer"})
            await pc.close()
            assert (status, data["error"]["code"]) == (400, "no_audio")

            status, data, _ = await post(url, raw=b"x" * (300 * 1024))
            assert (status, data["error"]["code"]) == (413, "body_too_large")

            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{url}/api/sessions/sess_nope") as r:
                    assert r.status == 404
                    assert (await r.json())["error"]["code"] == "session_not_found"
                async with http.get(f"{url}/api/nothing") as r:
                    assert r.status == 404 and "error" in await r.json()
            status, data, _ = await post(url, {"sdp": good, "type": "offer", "voice": "aiden"})
            assert status == 200 and data["type"] == "answer" and data["session_id"].startswith("sess_")
            assert metric(await metrics_text(url), 'rtc_agent_offers_rejected_total{reason="bad_request"}') >= 4

    run(main())


def test_token_is_required_when_set() -> None:
    async def main() -> None:
        async with server(token="s3cret") as (url, _):
            await wait_ready(url)
            good = await audio_offer()
            for token in (None, "wrong"):
                status, data, headers = await post(url, {"sdp": good, "type": "offer"}, token=token)
                assert (status, data["error"]["code"]) == (401, "unauthorized")
                assert headers.get("WWW-Authenticate") == "Bearer"
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/healthz") as r:
                    assert r.status == 200  # probes stay open
                async with http.get(f"{url}/api/config") as r:
                    assert r.status == 401
                async with http.get(f"{url}/api/config", headers={"Authorization": "Bearer s3cret"}) as r:
                    config = await r.json()
                    assert config["token_required"] and "ethan" in config["voices"]
                    assert config["video"] == {"fps": 2.0, "max_side": 384}  # the page sends video at this rate
            with pytest.raises(CallError) as refused:
                async with caller(url, token="wrong"):
                    pass
            assert refused.value.status == 401
            async with caller(url, token="s3cret") as (call, _):
                assert call.session_id

    run(main())


def test_capacity_gives_503_with_retry_after_and_frees_on_hang_up() -> None:
    async def main() -> None:
        async with server(max_sessions=1) as (url, _):
            async with caller(url) as (first, _):
                status, data, headers = await post(url, {"sdp": await audio_offer(), "type": "offer"})
                assert (status, data["error"]["code"]) == (503, "server_full")
                assert int(headers["Retry-After"]) > 0
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"{url}/readyz") as r:
                        assert (await r.json())["sessions"] == 1
            # caller() hung up with DELETE: the slot is free again
            async with caller(url) as (second, _):
                assert second.session_id != first.session_id

    run(main())


def test_readyz_waits_for_the_model_and_offers_wait_too() -> None:
    async def main() -> None:
        async with server(None, model="tiny", device="cpu") as (url, _):  # it loads its own engine
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/healthz") as r:
                    assert r.status == 200
                async with http.get(f"{url}/readyz") as r:
                    assert (r.status, (await r.json())["status"]) == (503, "loading")
            status, data, headers = await post(url, {"sdp": await audio_offer(), "type": "offer"})
            assert (status, data["error"]["code"]) == (503, "not_ready") and "Retry-After" in headers
            await wait_ready(url)
            assert metric(await metrics_text(url), "rtc_agent_ready") == 1.0

    run(main())


@needs_espeak
def test_a_vanished_peer_is_cleaned_up_within_10_s(tmp_path) -> None:
    """A caller process killed mid-call (no hang-up, no DTLS close): its session goes within 10 s (with resuming
    off; test_network_faults.py covers a lost call waiting for its caller to resume it)."""
    wav = tmp_path / "long.wav"
    samples = np.tile(np.concatenate([speech(rate=24000), np.zeros(24000, np.float32)]), 4)
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000)
        w.writeframes((samples * 32767).astype(np.int16).tobytes())

    async def main() -> None:
        async with server(peer_timeout_s=3.0, resume_window_s=0.0) as (url, app):
            await wait_ready(url)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rtc_agent.cli", "call", url, "--wav", str(wav),
                "--ice-host-address", LOOPBACK[0], stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                for _ in range(300):
                    if metric(await metrics_text(url), "rtc_agent_active_sessions") == 1.0:
                        break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("the caller never connected")
                await asyncio.sleep(1.0)  # mid-call
                proc.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                await proc.wait()
                while metric(await metrics_text(url), "rtc_agent_active_sessions") != 0.0:
                    assert time.monotonic() - killed_at < 10.0, "the session outlived its peer"
                    await asyncio.sleep(0.2)
                assert len(app[STATE].sessions) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    run(main())


def test_https_with_a_self_signed_certificate_and_the_page(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tls, "CACHE", tmp_path)

    async def main() -> None:
        s = settings(self_signed=True)
        assert s.scheme == "https"
        async with server(ssl_context=tls.server_context(s)) as (url, _):
            client = ssl.create_default_context(cafile=str(next(tmp_path.glob("*.pem"))))
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/healthz", ssl=client) as r:  # the certificate names 127.0.0.1
                    assert r.status == 200
                async with http.get(f"{url}/", ssl=client) as r:
                    assert r.status in (200, 404)  # 404 names the missing rtc_agent/web/index.html
                    assert "html" in (await r.text()).lower()

    run(main())
