#!/usr/bin/env bash
# Function calls on a GPU machine, full-size synthetic model (docs/performance.md, "Function calls and the language lock"): the engine
# bench without tools (1 session: the first packet), with tools offered (8 sessions, --tools auto: the first packet
# and the Thinker step with and without every row masked), then written answers at 8 sessions unconstrained and as
# calls (--tools required: the model picks the tool; --tools named: each tool in turn), every call checked against
# its tool's schema with jsonschema.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says): OUT=dir bash studies/device_tools.sh
set -u
out=${OUT:-artifacts/tools}; mkdir -p "$out"
model=${MODEL:-synthetic:30b-a3b}
export PYTHONUNBUFFERED=1
bench() {
    local name=$1; shift
    timeout 240 python3 -m rtc_agent.engine.bench --model "$model" --json "$@" > "$out/$name.json" 2> "$out/$name.err" \
        || { echo "$name failed:"; tail -20 "$out/$name.err"; return; }
    python3 - "$out/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[1], {k: r.get(k) for k in ("sessions", "ttfp_ms", "ttft_ms", "frame_ms", "token_ms", "rtf",
                                          "startup_s", "gpu_peak_gb")})
print("   stages", r.get("stage_ms"))
tools = r.get("tools")
if tools:
    print("   tools", {k: v for k, v in tools.items() if k != "made"})
PY
}
bench none-1 --sessions 1 --turns 3
bench auto-8 --sessions 8 --turns 3 --tools auto
bench text-8 --sessions 8 --turns 3 --no-talker --answer-tokens 128
bench calls-8 --sessions 8 --turns 8 --no-talker --tools required --answer-tokens 200
bench named-8 --sessions 8 --turns 5 --no-talker --tools named --answer-tokens 200
python3 - "$out/calls-8.json" "$out/named-8.json" <<'PY'
import json, sys
import jsonschema
from rtc_agent.engine.bench import BENCH_TOOLS
schemas = {tool.name: tool.schema for tool in BENCH_TOOLS}
made = [call for path in sys.argv[1:] for call in json.load(open(path))["tools"]["made"]]
valid = 0
for call in made:
    try:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
        valid += 1
    except Exception as exc:  # noqa: BLE001  (counted and shown)
        print("INVALID", call, exc)
names = sorted({c["name"] for c in made})
print(f"calls: {len(made)}, valid against their schema: {valid}, tools named: {names}")
PY
