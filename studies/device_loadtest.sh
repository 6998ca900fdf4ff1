#!/usr/bin/env bash
# Many callers through the real server on a GPU machine (docs/performance.md, "Many callers at once"): the engine bench
# for 1 and 8 sessions, then `rtc-agent serve`: the server's first two calls with the camera on, then
# `rtc-agent loadtest` with 1, 4, 8 and 16 callers at once and 8 callers joining one after another while the others
# are mid-answer. Turns end by the 400 ms silence rule (server_vad): what is measured is the engine and the server,
# not the turn model.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says): OUT=dir bash studies/device_loadtest.sh [WAV] [VIDEO_WAV]
# (BENCH_SESSIONS="8": the bench for those session counts only; "" for none. CHECK=8: first the batched-vs-alone
# check, `checks.fast_path --sessions 8`. The graphed audio encoder's check, `checks.audio_encoder`, always runs.)
set -u
out=${OUT:-artifacts/loadtest}; mkdir -p "$out"
model=${MODEL:-synthetic:30b-a3b}
wav=${1:-question.wav}
video_wav=${2:-two_turn.wav}
url=http://127.0.0.1:${PORT:-8080}
export PYTHONUNBUFFERED=1
summary() {  # one line per run: what the issue's targets read
    python3 - "$1" <<'PY'
import json, sys
o = json.load(open(sys.argv[1]))["overall"]
print(sys.argv[1], {k: o.get(k) for k in ("connected", "answered", "heard_ms", "server_ttfp_ms", "engine_ttfp_ms",
                                          "interval_ms_p90", "frames_late", "frames_dropped", "gaps", "failures",
                                          "client_loop_lag_ms_max")})
PY
}
timeout 120 python3 -m studies.checks.audio_encoder > "$out/check-audio-encoder.json" \
    2> "$out/check-audio-encoder.err"
python3 - "$out/check-audio-encoder.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("audio encoder check", {"passed": r["passed"], "passes": [(p["frames"], p["graph_vs_eager"], p["vs_library"])
                                                                for p in r["passes"]]})
PY
if [ -n "${CHECK:-}" ]; then
    timeout 300 python3 -m studies.checks.fast_path --model "$model" --sessions "$CHECK" \
        > "$out/check-sessions.json" 2> "$out/check-sessions.err"
    python3 - "$out/check-sessions.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("check", {"passed": r["passed"], "per_session": [(s["tokens_equal"], s["frames_equal"], s.get("forced_gaps"))
                                                       for s in r.get("per_session", [r])]})
PY
    tail -3 "$out/check-sessions.err"
fi
for sessions in ${BENCH_SESSIONS-1 8}; do
    timeout 150 python3 -m rtc_agent.engine.bench --model "$model" --sessions "$sessions" --turns 3 --json \
        > "$out/bench-$sessions.json" 2> "$out/bench-$sessions.err" && cat "$out/bench-$sessions.json"
done
source "$(dirname "$0")/device_serve.sh"
serve "$out/serve.log" --max-sessions 16 --max-answer-s 12 --turn-detection server_vad
for n in 1 2; do  # the server's first call, then the next one
    timeout 120 python3 -m rtc_agent.cli call "$url" --wav "$video_wav" --video --json --ice-host-address 127.0.0.1 \
        > "$out/call-video-$n.json" 2> "$out/call-video-$n.err"
    python3 - "$out/call-video-$n.json" "$n" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1]))["turns"]:
    m = t["server"] or {}
    print(f"video call {sys.argv[2]}, turn:", {
        "heard_ms": t["client_latency_ms"], "server_ttfp_ms": m.get("ttfp_ms"),
        "engine": {k: (m.get("engine") or {}).get(k) for k in ("ttft_ms", "ttfp_ms")},
        "frames_late": m.get("frames_late")})
PY
done
loadtest() {
    local name=$1; shift
    timeout 150 python3 -m rtc_agent.cli loadtest "$url" --wav "$wav" --retry-s 200 --ice-host-address 127.0.0.1 \
        --json "$@" > "$out/$name.json" 2> "$out/$name.err"
    summary "$out/$name.json"
}
loadtest loadtest-1 --callers 1 --turns 3
loadtest loadtest-4 --callers 4
loadtest loadtest-8 --callers 8
loadtest loadtest-16 --callers 16
loadtest loadtest-8-joining --callers 8 --ramp-s 7
kill "$server"; wait "$server"
grep -E "slots|GB" "$out/serve.log" | head -5
