#!/usr/bin/env bash
# The memory guard on a real GPU (docs/memory.md): `rtc-agent serve` with the full-size synthetic model and its
# GPU memory capped (--gpu-memory-fraction) so that it idles just under the guard, N callers in progress, then
# memory pressure, then one more caller, who must be refused (503 server_full, reason memory) while the N finish
# with 0 errors; then, with the pressure gone, a caller is admitted again. Everything is printed to stdout.
#
# 1. Calibration: serve without a cap and with the guard off; read gpu_memory_used_gb / _total_gb at idle.
# 2. The cap: fraction = idle used / ((GUARD_PCT - MARGIN_PCT) % of the GPU), so the idle server sits MARGIN_PCT
#    below the guard. N callers connect (all admitted) and talk (rtc-agent loadtest, server_vad turns).
# 3. Pressure: while they talk, another process on the same GPU takes enough memory to lift the server's reading
#    PUSH_PCT above the guard (as a second model or replica loading on a shared GPU would). Why not the calls
#    themselves: a call's memory (KV caches, graphs) is reserved with its session slot at start-up, so callers
#    joining add next to nothing; the slot count already keeps calls within the memory (503 reason "slots").
#    The guard is for what comes on top: prefills of long video turns, cache rebuilds, other processes.
# 4. The extra caller (rtc-agent loadtest --callers 1): refused, reason memory; the log line says used/total.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says):
#   bash studies/device_memory_guard.sh question.wav      (espeak-ng -w question.wav "What is the weather ...?")
# Settings: CALLERS (4), GUARD_PCT (90), MARGIN_PCT (2), PUSH_PCT (3), MODEL (synthetic:30b-a3b), PORT (8080).
set -u
out=${OUT:-artifacts/memory_guard}; mkdir -p "$out"
model=${MODEL:-synthetic:30b-a3b}
wav=${1:-question.wav}
n=${CALLERS:-4}
guard=${GUARD_PCT:-90}
margin=${MARGIN_PCT:-2}
push=${PUSH_PCT:-3}
port=${PORT:-8080}
url=http://127.0.0.1:$port
export PYTHONUNBUFFERED=1

metric() {  # metric NAME: its value on /metrics now
    python3 - "$url/metrics" "$1" <<'PY'
import sys, urllib.request
name = sys.argv[2]
for line in urllib.request.urlopen(sys.argv[1], timeout=10).read().decode().splitlines():
    if line.split(" ")[0] == name:
        print(line.split(" ")[1]); break
else:
    print(0)
PY
}
serve() {  # serve PHASE ARGS...: start the server, wait until /readyz says ready (5 min at most)
    local phase=$1; shift
    python3 -m rtc_agent.cli serve --model "$model" --port "$port" --ice-host-address 127.0.0.1 \
        --max-sessions $((n + 2)) --max-answer-s 6 --turn-detection server_vad "$@" > "$out/serve-$phase.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do
        python3 -c "import urllib.request,sys; urllib.request.urlopen('$url/readyz', timeout=2)" 2>/dev/null && return 0
        kill -0 "$server" 2>/dev/null || { echo "serve ($phase) exited:"; tail -20 "$out/serve-$phase.log"; exit 1; }
        sleep 1
    done
    echo "serve ($phase) was not ready in 300 s"; tail -20 "$out/serve-$phase.log"; exit 1
}
stop() { kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; }
gauges() {
    local used total
    used=$(metric gpu_memory_used_gb); total=$(metric gpu_memory_total_gb)
    echo "$1: used $used GB of $total GB ($(python3 -c "print(round(100 * $used / max($total, 1e-9), 1))") %)," \
         "peak $(metric gpu_memory_peak_gb) GB, guard active $(metric rtc_agent_memory_guard_active)," \
         "calls $(metric rtc_agent_active_sessions)"
}
report() {  # report FILE: the loadtest's outcome per caller
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
o = r["overall"]
print(f"  {sys.argv[1]}: {o['connected']} connected, {o['answered']} answers, {o['failed']} failed {o['failures']}")
for c in r["callers"]:
    f = c["failure"]
    turns = [t["status"] for t in c["turns"]]
    print(f"    caller {c['caller']}: turns {turns}" + (f", FAILED {f}" if f else ""))
PY
}

echo "== 1. calibration: no cap, guard off, $((n + 2)) slots"
serve calibrate --memory-guard-pct 100
gauges "idle"
used=$(metric gpu_memory_used_gb)
device=$(metric gpu_memory_total_gb)
stop
[ "$device" = "0.0" ] && { echo "no GPU here (gpu_memory_total_gb is 0): nothing for the guard to read"; exit 2; }
fraction=$(python3 -c "print(round($used / (($guard - $margin) / 100 * $device), 4))")
echo "cap: fraction $fraction of $device GB = $(python3 -c "print(round($fraction * $device, 1))") GB:" \
     "the idle server sits ${margin} % under the ${guard} % guard"

echo "== 2. capped server, $n callers"
serve capped --gpu-memory-fraction "$fraction" --memory-guard-pct "$guard"
grep -E "capped|session slots" "$out/serve-capped.log" | sed 's/^/  log: /'
gauges "idle, capped"
timeout 200 python3 -m rtc_agent.cli loadtest "$url" --wav "$wav" --callers "$n" --turns 4 \
    --ice-host-address 127.0.0.1 --json > "$out/loadtest-n.json" 2> "$out/loadtest-n.err" &
callers=$!
for _ in $(seq 100); do [ "$(metric rtc_agent_active_sessions)" = "$n.0" ] && break; sleep 0.2; done
gauges "$n callers connected"
samples=$(for _ in $(seq 16); do metric gpu_memory_used_gb; sleep 0.25; done | sort -n | sed -n '1p;$p' | tr '\n' ' ')
echo "used while the $n callers talk (4 s, min max): $samples GB"

echo "== 3. pressure from another process on the GPU"
python3 - "$(metric gpu_memory_used_gb)" "$(metric gpu_memory_total_gb)" "$guard" "$push" > "$out/pressure.log" 2>&1 <<'PY' &
import sys, time, torch
used, total, guard, push = map(float, sys.argv[1:])
take = (guard + push) / 100 * total - used  # GB: lifts the server's reading `push` % above its guard
block = torch.empty(int(take * 1e9), dtype=torch.uint8, device="cuda")
print(f"took {take:.1f} GB", flush=True)
time.sleep(600)
PY
pressure=$!
for _ in $(seq 150); do [ "$(metric rtc_agent_memory_guard_active)" = "1.0" ] && break; sleep 0.2; done
cat "$out/pressure.log" | sed 's/^/  pressure: /'
gauges "under pressure"

echo "== 4. one caller more"
timeout 60 python3 -m rtc_agent.cli loadtest "$url" --wav "$wav" --callers 1 --ice-host-address 127.0.0.1 --json \
    > "$out/loadtest-extra.json" 2> "$out/loadtest-extra.err"
report "$out/loadtest-extra.json"
grep -E "memory guard|call refused" "$out/serve-capped.log" | sed 's/^/  log: /'
wait "$callers"
echo "the $n callers in progress:"
report "$out/loadtest-n.json"
grep -c "out_of_memory\|out of GPU memory" "$out/serve-capped.log" | sed 's/^/  out-of-memory errors in the log: /'

echo "== 5. pressure gone: admitted again"
kill "$pressure"; wait "$pressure" 2>/dev/null
sleep 1
gauges "after"
timeout 60 python3 -m rtc_agent.cli loadtest "$url" --wav "$wav" --callers 1 --ice-host-address 127.0.0.1 --json \
    > "$out/loadtest-after.json" 2> "$out/loadtest-after.err"
report "$out/loadtest-after.json"
echo "rejected offers: memory $(metric 'rtc_agent_offers_rejected_total{reason="memory"}')," \
     "full $(metric 'rtc_agent_offers_rejected_total{reason="full"}')"
stop
