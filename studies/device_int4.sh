#!/usr/bin/env bash
# INT4 on a GPU machine (docs/performance.md, "INT4"): the quality check (checks/int4.py) on the full-size synthetic
# model, then the engine bench with bf16 and with int4 weights in the same run (1 session, then SESSIONS at once).
# Usage (repo root, wheels installed as .whl/INSTALL.txt says): OUT=dir bash studies/device_int4.sh [STAGES]
# STAGES: any of check bench batch video audio (default: check bench batch); QUANTS: the modes (default "none int4");
# BENCH_TIMEOUT: seconds a bench may take (300). video: peak GPU memory with 30 s and 120 s of 2 fps video in a
# call; audio: 40 minutes of caller audio in one call (16 turns of 150 s).
set -u
out=${OUT:-artifacts/int4}; mkdir -p "$out"
model=${MODEL:-synthetic:30b-a3b}
stages=${1:-check bench batch}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {  # name, then bench flags; prints the JSON's headline numbers
    local name=$1; shift
    timeout "${BENCH_TIMEOUT:-300}" python3 -m rtc_agent.engine.bench --model "$model" --json "$@" > "$out/bench-$name.json" \
        2> "$out/bench-$name.err" || { echo "bench $name failed:"; tail -5 "$out/bench-$name.err"; return; }
    python3 - "$out/bench-$name.json" <<'PY'
import json, sys
o = json.load(open(sys.argv[1]))
print(sys.argv[1], {k: o.get(k) for k in ("quantize", "sessions", "ttfp_ms", "ttfp_ms_first_turn", "frame_ms", "rtf",
                                          "gpu_peak_gb", "load_s")})
PY
}
case " $stages " in *" check "*)
    timeout 500 python3 -m studies.checks.int4 --model "$model" ${SWEEP:+--sweep} --out "$out/check.json" 2> "$out/check.err" \
        || tail -20 "$out/check.err";;
esac
case " $stages " in *" bench "*)
    for q in ${QUANTS:-none int4}; do bench "$q-1" --quantize "$q" --sessions 1 --turns 4; done;;
esac
case " $stages " in *" batch "*)
    for q in ${QUANTS:-none int4}; do bench "$q-${SESSIONS:-8}" --quantize "$q" --sessions "${SESSIONS:-8}" --turns 2; done;;
esac
case " $stages " in *" video "*)
    for q in ${QUANTS:-none int4}; do
        bench "$q-video30" --quantize "$q" --turns 2 --video-s 30
        bench "$q-video120" --quantize "$q" --turns 2 --video-s 120
    done;;
esac
case " $stages " in *" audio "*)
    for q in ${QUANTS:-none int4}; do
        bench "$q-audio40min" --quantize "$q" --turns 16 --turn-s 150 --context-tokens 40960
    done;;
esac
