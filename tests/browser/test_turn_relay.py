"""Chromium calls through Debian's coturn with iceTransportPolicy "relay": the TURN credentials come from the
server's /api/config, the selected candidate pair is a relay one, and the agent's answer arrives."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
from browser_harness import DESKTOP, Server, dump

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(shutil.which("turnserver") is None, reason="coturn is not installed (apt)")]
SECRET = "browser-turn-secret"
TURN_PORT = 13478

# A relay-only peer connection made in the page: the fake microphone, the `events` channel, the offer to the
# server, then the selected pair from getStats and the first response.done.
RELAY_CALL = """async () => {
  const cfg = await (await fetch('/api/config')).json();
  const pc = new RTCPeerConnection({iceServers: cfg.ice_servers, iceTransportPolicy: 'relay'});
  const mic = await navigator.mediaDevices.getUserMedia({audio: true});
  pc.addTrack(mic.getAudioTracks()[0], mic);
  const dc = pc.createDataChannel('events');
  const done = new Promise((resolve) => dc.addEventListener('message', (e) => {
    const msg = JSON.parse(e.data);
    if (msg.type === 'response.done') resolve(msg.response);
  }));
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((resolve) => {
    if (pc.iceGatheringState === 'complete') return resolve();
    pc.addEventListener('icegatheringstatechange', () => pc.iceGatheringState === 'complete' && resolve());
  });
  const offered = pc.localDescription.sdp.split('\\r\\n').filter((l) => l.startsWith('a=candidate'));
  const r = await fetch('/api/offer', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                       body: JSON.stringify({sdp: pc.localDescription.sdp, type: 'offer'})});
  const answer = await r.json();
  await pc.setRemoteDescription({type: 'answer', sdp: answer.sdp});
  const response = await Promise.race(
      [done, new Promise((_, no) => setTimeout(() => no(new Error('no answer')), 40000))]);
  const stats = await pc.getStats();
  let pair = null, local = null, packets = 0;
  stats.forEach((s) => { if (s.type === 'transport') pair = stats.get(s.selectedCandidatePairId); });
  if (pair) local = stats.get(pair.localCandidateId);
  stats.forEach((s) => { if (s.type === 'inbound-rtp' && s.kind === 'audio') packets = s.packetsReceived; });
  await fetch('/api/sessions/' + answer.session_id, {method: 'DELETE'});
  pc.close();
  return {offered, local: local && local.candidateType, response_status: response.status,
          frames: response.metrics.frames_sent, packets, turn_urls: cfg.ice_servers.map((s) => s.urls)};
}"""


def test_chromium_relay_only_call_through_coturn(net: Any, start_server: Callable[..., Server],
                                                 new_page: Callable[..., Any], artifacts: Path) -> None:
    log = open(artifacts / "browser" / "coturn.log", "wb")
    turn = subprocess.Popen(net.command([
        "turnserver", "-n", "--listening-ip=127.0.0.1", f"--listening-port={TURN_PORT}", "--relay-ip=127.0.0.1",
        "--min-port=49210", "--max-port=49250", "--use-auth-secret", f"--static-auth-secret={SECRET}",
        "--realm=rtc-agent.test", "--allow-loopback-peers", "--no-cli", "--no-tls", "--no-dtls", "--fingerprint",
        f"--pidfile={artifacts / 'browser' / 'coturn.pid'}", f"--userdb={artifacts / 'browser' / 'coturn.db'}"]),
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        server = start_server(18093, "--max-answer-s", "1", "--turn-url",
                              f"turn:127.0.0.1:{TURN_PORT}?transport=udp", "--turn-secret", SECRET)
        page = new_page(DESKTOP)
        page.goto(server.url + "/")
        result = page.evaluate(RELAY_CALL)
    finally:
        turn.terminate()
        turn.wait(10)
    assert result["offered"] and all(" typ relay " in c for c in result["offered"]), dump(result)
    assert result["local"] == "relay", dump(result)
    # The answer streamed through the relay; it may be cut by the caller's next utterance (the WAV loops), as in
    # test_call_page, which CI's loaded machine showed once.
    assert result["response_status"] in ("incomplete", "cancelled") and result["frames"] > 0, dump(result)
    assert result["packets"] > 10, dump(result)
