"""grouped.py's prefill experts: the routing's counting sort, and the grouped products against the library's MoE
blocks and plain PyTorch, all under Triton's CPU interpreter (the same kernels the GPU runs)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_CHECK = """
import torch
from rtc_agent.engine.model import loader
from rtc_agent.engine.model.kernels import grouped, moe

generator = torch.Generator().manual_seed(0)

# route: every pair once, grouped by expert, with its token; starts and tiles from the counts
for tokens, top_k, experts, block_m in ((1, 2, 8, None), (300, 8, 128, None), (100, 6, 128, 16), (700, 2, 8, 64)):
    selected = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    routes = grouped.route(selected, experts, block_m)
    order = routes.order.long()
    assert torch.equal(order.sort().values, torch.arange(tokens * top_k)), "a pair lost or doubled"
    by_expert = selected.reshape(-1)[order]
    assert torch.all(by_expert[1:] >= by_expert[:-1]), "pairs not grouped by expert"
    assert torch.equal(routes.tokens.long(), order // top_k)
    counts = torch.bincount(selected.reshape(-1), minlength=experts)
    zero = torch.zeros(1, dtype=torch.long)
    assert torch.equal(routes.starts.long(), torch.cat((zero, counts.cumsum(0))))
    assert torch.equal(routes.tiles.long(), torch.cat((zero, (-(-counts // routes.block_m)).cumsum(0))))

# route with tokens left out (a decode step's rows sitting it out): only the others' pairs, grouped by expert
selected = torch.stack([torch.randperm(128, generator=generator)[:8] for _ in range(24)])
active = torch.rand(24, generator=generator) < 0.5
routes = grouped.route(selected, 128, active=active.long())
placed = int(routes.starts[-1])
kept = torch.arange(24 * 8).view(24, 8)[active].reshape(-1)
assert not routes.complete and placed == kept.numel()
order = routes.order[:placed].long()
assert torch.equal(order.sort().values, kept), "a pair of a token left out placed, or one taking part lost"
by_expert = selected.reshape(-1)[order]
assert torch.all(by_expert[1:] >= by_expert[:-1])
assert torch.equal(routes.starts.long()[1:], torch.bincount(selected[active].reshape(-1), minlength=128).cumsum(0))

def rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

# the products alone, sizes that are no multiple of the tiles: gated and routed-weighted
worst = 0.0
x = torch.randn(30, 96, generator=generator)
weight = torch.randn(4, 80, 96, generator=generator)
selected = torch.randint(0, 4, (30, 1), generator=generator)
routing = torch.rand(30, generator=generator)
routes = grouped.route(selected, 4)
for gated in (True, False):
    out = grouped.matmul(x, weight, routes, routes.tokens, routes.order, gated=gated, routing=routing)
    full = torch.einsum("tk,tnk->tn", x, weight[selected[:, 0]])
    ref = (torch.nn.functional.silu(full[:, :40]) * full[:, 40:] if gated else full) * routing[:, None]
    worst = max(worst, rel(out, ref))
print("products", worst)

# whole blocks of the tiny model (Thinker's, and Talker's with its shared expert) against the library's forward
for dtype in (torch.float32, torch.bfloat16):
    model = loader.load("tiny", "cpu").model.to(dtype)
    worst, differing, total = 0.0, 0, 0
    with torch.inference_mode():
        for block in (m for m in model.modules() if moe._is_moe_block(m)):
            for shape in ((1, 3), (2, 20), (1, 100)):
                h = torch.randn(*shape, block.experts.hidden_dim, generator=generator).to(dtype)
                out, ref = moe.moe_forward(block, h, moe.experts_grouped), type(block).forward(block, h)
                worst, differing, total = max(worst, rel(out, ref)), differing + (out != ref).sum().item(), \
                    total + out.numel()
    print(dtype, differing / total, worst)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_grouped_experts_equal_library_blocks_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    products, fp32, bf16 = (line.split()[-2:] for line in out.stdout.strip().splitlines()[-3:])
    assert float(products[-1]) < 1e-5  # fp32: the same sums up to their order
    assert float(fp32[-1]) < 1e-5
    # bf16, the library's rounding points: the same but where fp32 sums in another order round to the next step
    differing, worst = map(float, bf16)
    assert differing < 0.01 and worst < 0.01, bf16
