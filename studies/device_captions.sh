#!/usr/bin/env bash
# Captions on a GPU machine (docs/captions.md): `rtc-agent serve` with its defaults (full-size synthetic model,
# media processes, captions on), then A/B in one run on that server: one caller, then 24 callers at once (LOADS),
# each with and without captions, RUNS times (on, off, then off, on, ...). Each load test's JSON is kept;
# one summary line per run gives heard latency, the captions and each server process's CPU.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says, the Moonshine model files importable as the
# moonshine_cpp package: PYTHONPATH): OUT=dir bash studies/device_captions.sh [WAV]
# (LOADS, RUNS, TURNS, CALLERS as below; SERVE_ARGS="--max-answer-s 8": more serve flags)
set -u
out=${OUT:-artifacts/captions}; mkdir -p "$out"
model=${MODEL:-synthetic:30b-a3b}
wav=${1:-.whl/question.wav}
callers=${CALLERS:-24}
url=http://127.0.0.1:${PORT:-8080}
export PYTHONUNBUFFERED=1
summary() {  # what the targets read, from one loadtest --json
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
o = r["overall"]
cpu = {name: p["cpu_pct"] for name, p in r["server_processes"].items()}
media = sum(v for k, v in cpu.items() if k.startswith("m"))
print(sys.argv[1], {k: o.get(k) for k in ("connected", "answered", "turns", "captioned", "heard_ms", "server_ttfp_ms",
                                          "caption_ms", "frames_late", "failures")},
      {"cpu_pct": cpu, "media_cpu_pct_per_caller": round(media / max(1, o["callers"]), 1)})
PY
}
source "$(dirname "$0")/device_serve.sh"
# shellcheck disable=SC2086  # (SERVE_ARGS: several flags)
serve "$out/serve.log" ${SERVE_ARGS:-}
grep -m1 "ready:" "$out/serve.log" | cut -c1-200
for n in $(seq "${RUNS:-2}"); do  # (the random-weight model speaks each answer to the --max-answer-s default: 30 s)
    order="on off"; [ $((n % 2)) = 0 ] && order="off on"  # (which goes first alternates)
    for load in ${LOADS:-1 $callers}; do
        for captions in $order; do
            flag=(); [ "$captions" = off ] && flag=(--no-captions)
            name="$out/callers$load-$captions-$n"
            timeout 200 python3 -m rtc_agent.cli loadtest "$url" --callers "$load" --turns "${TURNS:-2}" --wav "$wav" \
                --json --ice-host-address 127.0.0.1 "${flag[@]}" > "$name.json" 2> "$name.err"
            summary "$name.json"
        done
    done
done
kill -INT "$server"; wait "$server"
grep -c "Traceback" "$out/serve.log"
