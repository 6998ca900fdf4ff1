"""Checks a WebRTC SDP offer before aiortc sees it.

aiortc trusts its peer: an offer whose BUNDLE group names a missing mid fails inside createAnswer, one without ICE
credentials or fingerprint waits for a connection that cannot come, an audio line that does not send holds a
slot with no microphone behind it, and every extra media line costs a transceiver with its own threads. A call
here needs exactly what a browser sends: one audio line that sends Opus, at most one video line (VP8 or H.264)
and at most one data channel, all over ICE + DTLS. Anything else is refused with a ProtocolError (`no_audio`
when the offer has no sending microphone, `invalid_sdp` otherwise) and nothing is allocated.
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

from .errors import ProtocolError

MAX_LINE = 4096
SECURE_RTP = "UDP/TLS/RTP/SAVPF"
PROTOCOLS = {"audio": {SECURE_RTP}, "video": {SECURE_RTP}, "application": {"UDP/DTLS/SCTP", "DTLS/SCTP"}}
CODECS = {"audio": {"opus/48000"}, "video": {"vp8/90000", "h264/90000"}}  # what aiortc can take and we use
DIRECTIONS = {"sendrecv", "sendonly", "recvonly", "inactive"}
_LINE = re.compile(r"^[a-z]=[^\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]*$")  # (a lone surrogate is not text)
_MEDIA = re.compile(r"^m=(\w+) (\d+)(?:/\d+)? (\S+)((?: \S+)+)$")
_TOKEN = re.compile(r"^[!#$%&'*+\-.0-9A-Z^_`a-z{|}~]{1,64}$")  # RFC 4566 token: what a mid may be
_ICE_CHARS = re.compile(r"^[A-Za-z0-9+/]+$")
_FINGERPRINT = re.compile(r"^(sha-256|sha-384|sha-512) [0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2})+$", re.I)
_RTPMAP = re.compile(r"^(\d+) ([^/\s]+)/(\d+)")


@dataclass
class _Section:
    number: int
    kind: str = "session"
    port: int = 0
    protocol: str = ""
    formats: list[str] = field(default_factory=list)
    attributes: dict[str, list[str]] = field(default_factory=dict)

    def first(self, name: str) -> str | None:
        values = self.attributes.get(name)
        return values[0] if values else None

    def flags(self) -> set[str]:
        return {name for name, values in self.attributes.items() if "" in values}


def _invalid(message: str) -> ProtocolError:
    return ProtocolError("invalid_sdp", message)


def _sections(sdp: str) -> tuple[_Section, list[_Section]]:
    lines = sdp.split("\r\n") if "\r\n" in sdp else sdp.split("\n")
    while lines and not lines[-1]:
        lines.pop()
    session, media = _Section(0), []
    current = session
    for number, line in enumerate(lines, 1):
        if line.startswith("m="):
            current = _Section(number)
            media.append(current)
            parsed = _MEDIA.match(line)
            if parsed is None or int(parsed.group(2)) > 65535:
                raise _invalid(f"line {number} is not a media line (m=<media> <port> <protocol> <formats>)")
            current.kind, port, current.protocol, formats = parsed.groups()
            current.port, current.formats = int(port), formats.split()
        elif line.startswith("a="):
            name, _, value = line[2:].partition(":")
            current.attributes.setdefault(name, []).append(value)
        if len(line) > MAX_LINE or not _LINE.match(line):
            raise _invalid(f"line {number} is not an SDP line (type=value, printable, at most {MAX_LINE} chars)")
    return session, media


def _check_transport(session: _Section, section: _Section) -> str:
    """Raises ProtocolError unless `section` has ICE credentials and a DTLS fingerprint; returns the credentials
    (`ufrag pwd`)."""
    where = f"the {section.kind} line (line {section.number})"
    ufrag = section.first("ice-ufrag") or session.first("ice-ufrag")
    pwd = section.first("ice-pwd") or session.first("ice-pwd")
    fingerprint = section.first("fingerprint") or session.first("fingerprint")
    if not ufrag or not 4 <= len(ufrag) <= 256 or not _ICE_CHARS.match(ufrag):
        raise _invalid(f"{where} has no valid a=ice-ufrag (4-256 ICE characters)")
    if not pwd or not 22 <= len(pwd) <= 256 or not _ICE_CHARS.match(pwd):
        raise _invalid(f"{where} has no valid a=ice-pwd (22-256 ICE characters)")
    if not fingerprint or not _FINGERPRINT.match(fingerprint):
        raise _invalid(f"{where} has no DTLS fingerprint (a=fingerprint:sha-256 with hex pairs)")
    setup = section.first("setup") or session.first("setup")
    if setup is not None and setup not in ("actpass", "active", "passive"):
        raise _invalid(f"{where} has a=setup:{setup[:20]!r}")
    return f"{ufrag} {pwd}"


def _check_codecs(section: _Section) -> None:
    wanted = CODECS.get(section.kind)
    if not wanted:
        return
    for rtpmap in section.attributes.get("rtpmap", []):
        parsed = _RTPMAP.match(rtpmap)
        if parsed and parsed.group(1) in section.formats and f"{parsed.group(2)}/{parsed.group(3)}".lower() in wanted:
            return
    raise _invalid(f"the {section.kind} line (line {section.number}) offers no codec in common with the server "
                   f"({', '.join(sorted(wanted))})")


def _direction(session: _Section, section: _Section) -> str:
    for candidate in (section, session):
        found = candidate.flags() & DIRECTIONS
        if len(found) > 1:
            raise _invalid(f"line {candidate.number}: more than one direction attribute")
        if found:
            return found.pop()
    return "sendrecv"


def check_offer(sdp: str) -> str:
    """Checks `sdp` (an offer's text); raises ProtocolError when a call cannot be made of it. Returns the ICE
    credentials of its audio line (`ufrag pwd`), by which the same offer made again is known."""
    if not sdp.startswith("v=0"):
        raise _invalid("an SDP offer starts with v=0")
    session, media = _sections(sdp)
    counts = collections.Counter(section.kind for section in media)
    if not counts["audio"]:
        raise ProtocolError("no_audio", "the offer has no audio: the call needs a microphone track")
    for kind, count in counts.items():
        if kind not in PROTOCOLS:
            raise _invalid(f"the offer has a {kind[:20]!r} media line: only audio, video and application are taken")
        if count > 1:
            raise _invalid(f"the offer has {count} {kind} lines: at most one audio, one video and one data channel "
                           "line are taken")
    mids, ice = [], ""
    for section in media:
        where = f"the {section.kind} line (line {section.number})"
        if section.protocol not in PROTOCOLS[section.kind]:
            raise _invalid(f"{where} uses {section.protocol[:40]!r}: WebRTC media needs "
                           f"{' or '.join(sorted(PROTOCOLS[section.kind]))} (ICE + DTLS)")
        mid = section.first("mid")
        if mid is None or not _TOKEN.match(mid) or mid in mids:
            raise _invalid(f"{where} needs a unique a=mid (a token of 1-64 characters)")
        mids.append(mid)
        credentials = _check_transport(session, section)
        ice = credentials if section.kind == "audio" else ice
        _check_codecs(section)
        direction = _direction(session, section)
        if section.kind == "audio" and (section.port == 0 or direction in ("recvonly", "inactive")):
            raise ProtocolError("no_audio", "the offer's audio line does not send: the call needs a microphone track")
        if section.port == 0:
            raise _invalid(f"{where} has port 0 (a rejected line)")
    for group in session.attributes.get("group", []):
        semantics, *names = group.split(" ")
        missing = [name for name in names if name not in mids]
        if semantics == "BUNDLE" and (missing or not names):
            raise _invalid(f"a=group:BUNDLE names a mid that no media line has: {(missing or [''])[0][:64]!r}")
    return ice
