#!/usr/bin/env bash
# The first camera calls after a start, then many callers, on one server (docs/performance.md, "Camera"):
# `rtc-agent serve` with its defaults (full-size synthetic model), CALLS camera calls one after another, each
# saying WAV's turns with the camera on (a moving test pattern), then LOADS callers at once (captions on). Per
# camera-call turn: heard and the server's first packet; per load test the summary line; at the end the server's
# shutdown, whose log should hold no traceback.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says, the Moonshine model files importable as the
# moonshine_cpp package: PYTHONPATH): OUT=dir bash studies/device_camera.sh TWO_TURN_WAV [LOAD_WAV]
# (CALLS=2, LOADS="24", TURNS=2, SERVE_ARGS="--max-answer-s 8": more serve flags)
set -u
out=${OUT:-artifacts/camera}; mkdir -p "$out"
model=${MODEL:-synthetic:30b-a3b}
wav=${1:-.whl/two_turn.wav}
load_wav=${2:-.whl/thanks.wav}
url=http://127.0.0.1:${PORT:-8080}
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_serve.sh"
# shellcheck disable=SC2086  # (SERVE_ARGS: several flags)
serve "$out/serve.log" ${SERVE_ARGS:-}
grep -m1 "warmed up" "$out/serve.log" | cut -c1-200
for n in $(seq "${CALLS:-2}"); do
    timeout 120 python3 -m rtc_agent.cli call "$url" --wav "$wav" --video --json --ice-host-address 127.0.0.1 \
        > "$out/call-video-$n.json" 2> "$out/call-video-$n.err"
    python3 - "$out/call-video-$n.json" "$n" <<'PY'
import json, sys
for i, t in enumerate(json.load(open(sys.argv[1]))["turns"], 1):
    m = t["server"] or {}
    print(f"camera call {sys.argv[2]}, turn {i}:", {"heard_ms": t["client_latency_ms"], "server_ttfp_ms": m.get("ttfp_ms"),
                                                 "video": m.get("video")})
PY
done
for load in ${LOADS:-24}; do
    name="$out/callers$load"
    timeout 200 python3 -m rtc_agent.cli loadtest "$url" --callers "$load" --turns "${TURNS:-2}" --wav "$load_wav" \
        --json --ice-host-address 127.0.0.1 > "$name.json" 2> "$name.err"
    python3 - "$name.json" <<'PY'
import json, sys
o = json.load(open(sys.argv[1]))["overall"]
print(sys.argv[1], {k: o.get(k) for k in ("connected", "answered", "turns", "captioned", "heard_ms", "server_ttfp_ms",
                                          "caption_ms", "frames_late", "failures")})
PY
done
kill -INT "$server"; wait "$server"
echo "serve exit $?; tracebacks in its log: $(grep -c Traceback "$out/serve.log"); errors: $(grep -c ' ERROR ' "$out/serve.log")"
grep -B2 -A12 -m2 Traceback "$out/serve.log" | cut -c1-200
