"""The short-query attention against the library's SDPA, on CPU."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_for

from rtc_agent.engine.model.kernels import attention
from rtc_agent.engine.model.kv_cache import StaticKVCache
from rtc_agent.engine.model.stack import run_stack


@pytest.mark.parametrize("count, masked, rows", [(1, False, 1), (1, True, 1), (7, True, 1), (32, True, 1),
                                                 (1, True, 3), (8, True, 3), (32, True, 3)])
def test_short_query_attention_equals_sdpa(count, masked, rows):
    """Decode steps (the matmul path) and padded prefills (the packed SDPA), one row or a batch of rows each
    at its own length."""
    engine = engine_for(prefill_chunk_s=0)
    module = engine.model.thinker.model.language_model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, length, dim = 4, 2, 300, 16
    query = torch.randn(rows, count, heads, dim, generator=gen).transpose(1, 2)  # laid out as the library's
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=gen) for _ in range(2))
    # causal over the last `count` of each row's filled positions (217, 150, 290); the rest of the buffer is empty
    ends = torch.tensor([217, 150, 290][:rows])
    queries = ends[:, None, None] - count + torch.arange(count)[None, :, None]
    mask = (torch.arange(length)[None, None] <= queries)[:, None] if masked else None
    ours, _ = attention.decode_attention(module, query, key, value, mask, scaling=dim ** -0.5)
    stock, _ = attention.sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    assert ours.shape == stock.shape == (rows, count, heads, dim)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_installed_decode_step_equals_the_library():
    """A Thinker decode step through the installed attention equals one through the library's SDPA."""
    engine = engine_for(prefill_chunk_s=0)
    lm = engine.model.thinker.model.language_model
    config = engine.model.thinker.config.text_config
    embeds = torch.randn(1, 40, config.hidden_size, generator=torch.Generator().manual_seed(1))
    outputs = []
    for enabled in (False, True):
        attention.install(engine.model, enabled=enabled)
        cache = StaticKVCache.for_config(config, 64, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            run_stack(lm, embeds[:, :39], cache, mrope=True)
            outputs.append(run_stack(lm, embeds[:, 39:], cache, mrope=True)[0])
        assert attention.active(engine.model) == enabled
    attention.install(engine.model, enabled=False)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    assert config._attn_implementation == "sdpa" and not attention.active(engine.model)
