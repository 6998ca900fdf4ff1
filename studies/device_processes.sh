#!/usr/bin/env bash
# Callers per GPU through `rtc-agent serve` as processes by role (docs/performance.md, "Processes by role"), on a
# GPU machine, full-size synthetic model. Part 1: the server's defaults (semantic_vad, slots as fit, media
# processes auto): 1 caller (3 turns), 8, 16 and 24 at once, then 8 at once with one media process killed (SIGKILL)
# mid-call. Part 2: `--turn-detection server_vad --max-sessions 32`: 8 and 32 at once.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says): OUT=dir bash studies/device_processes.sh 1|2 [WAV]
# (SERVE_ARGS="--quantize int4": more serve flags for part 1; CALLERS="1 8 16": its loads, each "N at once", or
# "N:file.wav" to say another WAV, "N@R" to start the N callers over R seconds, 3 turns each; KILL=0: no SIGKILL
# run; TRACE=1: the engine worker's trace, with the GPU time of each round and step, in the output as trace.<pid>
# for studies/worker_trace.py)
set -u
part=${1:-1}
wav=${2:-.whl/question.wav}
out=${OUT:-artifacts/processes}; mkdir -p "$out"
[ "${TRACE:-0}" = 1 ] && export RTC_AGENT_WORKER_TRACE=$out/trace
model=${MODEL:-synthetic:30b-a3b}
url=http://127.0.0.1:${PORT:-8080}
source "$(dirname "$0")/device_serve.sh"
answer_s=${ANSWER_S:-8}  # shorter answers than the default 30 s: the same latencies in less device time
export PYTHONUNBUFFERED=1
summary() {
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
o = r["overall"]
print(sys.argv[1], {k: o.get(k) for k in ("connected", "answered", "cut_ins", "failures", "heard_ms", "server_ttfp_ms",
                                          "engine_ttfp_ms", "end_of_turn_wait_ms", "verdict_ms", "decisions_on_engine",
                                          "engine_frame_ms_p90", "frames_late", "gaps", "speech_end_spread_ms",
                                          "server_loop_lag_ms_max", "client_loop_lag_ms_max")})
for name, p in r.get("server_processes", {}).items():
    print("   ", name, p)
PY
}
start_server() {
    serve "$out/serve-$part.log" --max-answer-s "$answer_s" "$@"
    echo "$(date +%T) ready"; grep -E "slots|media processes|serving on" "$out/serve-$part.log" | head -5
}
loadtest() {
    local name=$1 speech=$2; shift 2
    echo "$(date +%T) $name"
    timeout 200 python3 -m rtc_agent.cli loadtest "$url" --wav "$speech" --retry-s 60 --ice-host-address 127.0.0.1 \
        --json "$@" > "$out/$name.json" 2> "$out/$name.err"
    summary "$out/$name.json"
}
readyz() { python3 -c "import json, urllib.request; print(json.dumps(json.load(urllib.request.urlopen('$url/readyz'))))"; }
if [ "$part" = 1 ]; then
    start_server ${SERVE_ARGS:-}
    i=0
    for load in ${CALLERS:-1 8 16 24}; do  # a load may repeat ("24 24 24"): each has its own file
        spec=${load%%:*}; w=$([ "$load" = "$spec" ] && echo "$wav" || echo "${load#*:}")  # N or N:other.wav
        n=${spec%%@*}; ramp=$([ "$spec" = "$n" ] || echo "--ramp-s ${spec#*@} --turns 3")  # N@R: ramped
        i=$((i + 1))
        loadtest "loadtest-$i-$n" "$w" --callers "$n" $([ "$n" = 1 ] && echo --turns 3) $ramp
    done
fi
if [ "$part" = 1 ] && [ "${KILL:-1}" = 1 ]; then
    # 8 at once; once all 8 are in, SIGKILL the media process with the most calls
    loadtest loadtest-8-kill "$wav" --callers 8 &
    tester=$!
    for _ in $(seq 1 120); do
        python3 -c "import json, sys, urllib.request; sys.exit(json.load(urllib.request.urlopen('$url/readyz'))['active'] < 8)" \
            2> /dev/null && break
        sleep 0.25
    done
    sleep 3
    victim=$(python3 -c "import json, urllib.request; r = json.load(urllib.request.urlopen('$url/readyz'));
p = max(r['media_processes'], key=lambda p: p['calls']); print(p['pid'], p['mark'], p['calls'])")
    echo "killing media process (pid mark calls): $victim"
    kill -9 ${victim%% *}
    wait "$tester"
    sleep 5; readyz
    python3 - "$out/loadtest-8-kill.json" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["callers"]:
    s = c["summary"]
    print(c["session_id"], (c["failure"] or {}).get("code"), "answered", s["answered"], "late", s["frames_late"],
          "heard", s["heard_ms"]["p50"], "resumed", c.get("resumes"))
PY
fi
if [ "$part" = 2 ]; then
    start_server --turn-detection server_vad --max-sessions 32
    loadtest loadtest-8-server-vad "$wav" --callers 8
    loadtest loadtest-8-server-vad-2 "$wav" --callers 8
    loadtest loadtest-32-server-vad "$wav" --callers 32
fi
kill -INT "$server"; wait "$server"
grep -E "ERROR|Traceback" "$out/serve-$part.log" | head -20
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && rm -r "$out"  # one file back
