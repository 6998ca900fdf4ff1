"""rtc-agent serve | call | loadtest | talk | bench."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from .config import VOICES, add_server_arguments, settings_from_args


def _client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8080")
    p.add_argument("--token", help="bearer token, when the server was started with --token")
    p.add_argument("--voice", choices=VOICES)
    p.add_argument("--instructions", help="system prompt for this call")
    p.add_argument("--insecure", action="store_true", help="accept a self-signed certificate")
    p.add_argument("--ice-server", dest="ice_servers", action="append", default=[],
                   help="STUN/TURN server (as for serve), repeatable")
    p.add_argument("--ice-host-address", dest="ice_host_addresses", action="append", default=[],
                   help="use only these addresses for host ICE candidates")
    p.add_argument("--relay-only", action="store_true",
                   help="use only TURN relay candidates (the server's /api/config TURN, or --ice-server turn:...)")
    p.add_argument("-v", "--verbose", action="store_true")


def parser(with_bench: bool = False) -> argparse.ArgumentParser:
    """The command line; the engine's bench flags are added only for `bench` (they import torch)."""
    top = argparse.ArgumentParser(prog="rtc-agent", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the call server")
    add_server_arguments(serve)

    call = sub.add_parser("call", help="call a server with a WAV as the microphone; print latencies")
    _client_arguments(call)
    call.add_argument("--wav", required=True, help="what the caller says: utterances separated by >= 1 s pauses")
    call.add_argument("--video", action="store_true",
                      help="send a camera track too (a moving test pattern, 640x480 at 15 fps)")
    call.add_argument("--json", action="store_true", help="print the report as JSON")
    call.add_argument("--record", metavar="WAV", help="write the answer audio here (24 kHz mono)")
    call.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answers after the WAV")
    call.add_argument("--no-captions", action="store_true", help="ask for no captions of the caller's words")

    load = sub.add_parser("loadtest", help="many callers at once: latencies, late frames, gaps and failures")
    _client_arguments(load)
    load.add_argument("--callers", type=int, default=1, help="callers, each its own aiortc peer (default 1)")
    load.add_argument("--ramp-s", type=float, default=0.0, help="start the callers evenly over this many seconds")
    load.add_argument("--wav", help="what each caller says (utterances separated by >= 1 s pauses); "
                      "default: an espeak-ng sentence")
    load.add_argument("--turns", type=int, default=1, help="times each caller says the whole WAV (default 1)")
    load.add_argument("--max-wait-s", type=float, default=30.0,
                      help="a turn's answer that has not ended this many seconds after the speech and after its "
                      "latest audio packet is a failure (a long answer that streams on is waited for; default 30)")
    load.add_argument("--retry-s", type=float, default=0.0,
                      help="wait up to this long for /readyz, then retry a 503 (server_full, not_ready) this long, "
                      "after its Retry-After (default 0: no waiting, a 503 is a failure)")
    load.add_argument("--gap-ms", type=float, default=120.0,
                      help="answer packets further apart than this count as a gap (default 120)")
    load.add_argument("--processes", type=int, default=0,
                      help="client processes to spread the callers over, each its own event loop (default 0: one "
                           "per 4 callers, at most half the cores)")
    load.add_argument("--json", action="store_true", help="print one JSON object: settings, overall, callers")
    load.add_argument("--no-captions", action="store_true", help="the callers ask for no captions of their words")

    talk = sub.add_parser("talk", help="a live call with this machine's microphone and speaker")
    _client_arguments(talk)

    bench = sub.add_parser("bench", help="measure the engine (see rtc_agent/engine/bench.py)")
    if with_bench:
        try:
            from .engine import bench as engine_bench
        except ImportError as exc:  # say why it is missing when it is asked for
            bench.set_defaults(bench_error=str(exc))
        else:
            engine_bench.add_arguments(bench)
    return top


def configure_logging(level: str, role: str | None = None) -> None:
    """The process's log lines; `role` names the process in each line (a server split into processes)."""
    where = f"[{role}] " if role else ""
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if logging.getLogger().level > logging.DEBUG:
        for noisy in ("aioice", "aiortc", "aiohttp.access"):  # per-check, per-packet and per-request lines
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _loadtest(args: argparse.Namespace) -> int:
    """Exit status 0 when every caller got every answer, 1 when any failed, 2 for bad arguments."""
    configure_logging("DEBUG" if args.verbose else "ERROR")  # a full server's refusals are in the report, not the log
    from .client.loadtest import ClientProcessError, LoadSettings, default_processes, print_loadtest, run_loadtest

    try:
        settings = LoadSettings(callers=args.callers, ramp_s=args.ramp_s, turns=args.turns,
                                max_wait_s=args.max_wait_s, retry_s=args.retry_s, gap_s=args.gap_ms / 1000,
                                processes=args.processes or default_processes(args.callers))
        report = asyncio.run(run_loadtest(
            args.url, args.wav, settings, token=args.token, voice=args.voice, instructions=args.instructions,
            verify_tls=not args.insecure, ice_servers=tuple(args.ice_servers),
            ice_host_addresses=tuple(args.ice_host_addresses), captions=not args.no_captions))
    except (OSError, ValueError) as exc:
        print(f"rtc-agent loadtest: {exc}", file=sys.stderr)
        return 2
    except ClientProcessError as exc:
        print(f"rtc-agent loadtest: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print_loadtest(report, args.json)
    return 1 if report["overall"]["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(with_bench=argv[:1] == ["bench"]).parse_args(argv)
    if args.command == "serve":
        try:
            settings = settings_from_args(args)
        except ValueError as exc:
            print(f"rtc-agent serve: {exc}", file=sys.stderr)
            return 2
        configure_logging(settings.log_level)
        from .server.processes import media_process_count, serve_split

        count = media_process_count(settings)
        if count:
            return asyncio.run(serve_split(settings, count))
        from .server.app import serve

        return asyncio.run(serve(settings))
    if args.command == "loadtest":
        return _loadtest(args)
    if args.command in ("call", "talk"):
        configure_logging("DEBUG" if args.verbose else "WARNING")
        common = dict(token=args.token, voice=args.voice, instructions=args.instructions,
                      verify_tls=not args.insecure, ice_servers=tuple(args.ice_servers),
                      ice_host_addresses=tuple(args.ice_host_addresses), relay_only=args.relay_only)
        from .client.peer import CallError

        try:
            if args.command == "call":
                from .client.call import print_report, run_call

                report = asyncio.run(run_call(args.url, args.wav, video=args.video, record=args.record,
                                              answer_timeout_s=args.timeout, captions=not args.no_captions,
                                              **common))
                print_report(report, args.json)
                return 0 if all(t["status"] != "no answer" for t in report["turns"]) else 1
            from .client.talk import run_talk

            return asyncio.run(run_talk(args.url, **common))
        except CallError as exc:
            print(f"rtc-agent {args.command}: the server refused the call: {exc}", file=sys.stderr)
            return 1
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            print(f"rtc-agent {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if args.command == "bench":
        if getattr(args, "bench_error", None):
            print(f"rtc-agent bench: the engine benchmark is not available ({args.bench_error})", file=sys.stderr)
            return 2
        configure_logging("INFO")
        from .engine import bench as engine_bench

        return int(engine_bench.run(args) or 0)
    return 2


if __name__ == "__main__":
    sys.exit(main())
