"""ICE details shared by the server and the client: STUN/TURN server strings and host candidate addresses."""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer, RTCIceTransportPolicy

_TURN = re.compile(r"^(?P<scheme>stuns?|turns?):(?:(?P<user>[^:@/]+):(?P<password>[^@/]+)@)?(?P<rest>.+)$")
_stock_get_host_addresses: Callable[[bool, bool], list[str]] = aioice.ice.get_host_addresses


def parse_ice_server(text: str) -> RTCIceServer:
    """`stun:host:port` or `turn:user:password@host:port?transport=udp` (credentials move out of the URL)."""
    m = _TURN.match(text.strip())
    if not m:
        raise ValueError(f"not a STUN/TURN URL: {text!r}")
    url = f"{m['scheme']}:{m['rest']}"
    return RTCIceServer(urls=url, username=m["user"], credential=m["password"])


def rtc_configuration(ice_servers: Iterable[str | RTCIceServer], relay_only: bool = False) -> RTCConfiguration:
    """relay_only: use TURN relay candidates only (iceTransportPolicy "relay"), as a caller behind a strict NAT."""
    servers = [s if isinstance(s, RTCIceServer) else parse_ice_server(s) for s in ice_servers]
    policy = RTCIceTransportPolicy.RELAY if relay_only else RTCIceTransportPolicy.ALL
    return RTCConfiguration(iceServers=servers, iceTransportPolicy=policy)


def ice_servers_from_config(entries: Iterable[dict[str, Any]]) -> list[RTCIceServer]:
    """/api/config's ice_servers (the browser's form, TURN credentials included) as aiortc servers."""
    return [RTCIceServer(urls=e["urls"], username=e.get("username"), credential=e.get("credential"))
            for e in entries]


def browser_ice_servers(ice_servers: Iterable[str]) -> list[dict[str, str]]:
    """The same servers in the form RTCPeerConnection({iceServers}) takes in a browser."""
    out = []
    for s in ice_servers:
        server = parse_ice_server(s)
        entry = {"urls": str(server.urls)}
        if server.username:
            entry |= {"username": server.username, "credential": str(server.credential)}
        out.append(entry)
    return out


def use_host_addresses(addresses: Iterable[str] = ()) -> None:
    """Chooses the addresses aioice gathers host candidates on, for every peer connection of this process.

    aioice leaves out 127.0.0.1. With `addresses` given, only those are used (127.0.0.1 keeps a test on
    loopback). Without, the stock list is used, and 127.0.0.1 where the machine has no other address (a
    network namespace with only `lo`, where a browser started with --allow-loopback-in-peer-connection calls).
    """
    fixed = [a for a in addresses if a]

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        if fixed:
            return [a for a in fixed if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]
        found = _stock_get_host_addresses(use_ipv4, use_ipv6)
        return found or (["127.0.0.1"] if use_ipv4 else [])

    aioice.ice.get_host_addresses = get_host_addresses
