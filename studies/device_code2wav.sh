#!/usr/bin/env bash
# Code2Wav's cut windows (code2wav.decoder_needs) on a GPU: the streamed samples against the one-shot decode on
# CUDA (a stream, and graphed rows as the engine runs them; float32 and bfloat16), then `rtc-agent bench` at 24
# and 1 callers, full-size synthetic model. With .whl/ab_old/ holding older engine files (e.g. `git show
# abc8101:rtc_agent/engine/code2wav.py > .whl/ab_old/code2wav.py`, the same for sampling.py) and .whl/ab_new/
# the current ones, the benches run new, old, new (A/B/A on one machine); VERSIONS and SESSIONS choose others.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says): OUT=dir [VERSIONS="new old"] [SESSIONS="24 1"]
#   bash studies/device_code2wav.sh
set -u -o pipefail
out=${OUT:-artifacts/code2wav}; mkdir -p "$out"
python3 - <<'PY'
import torch
from rtc_agent.engine.code2wav import Code2WavRows, StreamingCode2Wav
from rtc_agent.engine.engine import Engine
from rtc_agent.engine.options import EngineOptions

tiny = Engine.load(EngineOptions(model="tiny", device="cpu")).model.code2wav  # (only Code2Wav goes to the GPU)
for dtype in (torch.float32, torch.bfloat16):
    model = tiny.to("cuda", dtype)
    codes = torch.randint(0, 2048, (1, 16, 60), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        one_shot = model(codes)[0, 0].float()
        stream = StreamingCode2Wav(model, 128)
        streamed = torch.cat([stream.push(codes[0, :, k]) for k in range(codes.shape[-1])])
        rows = Code2WavRows(model, slots=8, max_frames=128, graphs=True)
        for size in (1, 2, 4, 8):
            rows.capture(size)
        graphed = torch.cat([rows.push([r.frames_before for r in rows.rows],
                                       codes[0, :, k].expand(8, -1).contiguous())[3] for k in range(codes.shape[-1])])
    lag = stream.lag
    print(dtype, "largest error: stream", (streamed[lag:] - one_shot[:len(streamed) - lag]).abs().max().item(),
          "graphed rows", (graphed[lag:] - one_shot[:len(graphed) - lag]).abs().max().item(),
          "(peak", one_shot.abs().max().item(), ")")
PY
versions=new
[ -d .whl/ab_old ] && [ -d .whl/ab_new ] && versions="new old new"
versions=${VERSIONS:-$versions}
n=0
for v in $versions; do
    n=$((n + 1))
    [ -d .whl/ab_$v ] && cp .whl/ab_$v/*.py rtc_agent/engine/
    for callers in ${SESSIONS:-24 1}; do
        name=$out/bench_${n}_${v}_$callers
        python3 -m rtc_agent.cli bench --model synthetic:30b-a3b --sessions $callers --turns 3 --json 2>"$name.log" \
            | tail -1 > "$name.json"
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], {k: d.get(k) for k in
            ('ttfp_ms', 'frame_ms', 'rtf', 'stage_ms', 'gpu_peak_gb')})" "$name.json" || tail -5 "$name.log"
    done
done
[ -d .whl/ab_new ] && cp .whl/ab_new/*.py rtc_agent/engine/
