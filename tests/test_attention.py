"""The short-query attention against the library's SDPA, on CPU."""
from __future__ import annotations

import pytest
import torch

from rtc_agent.engine.kernels import attention
from rtc_agent.engine.kv_cache import StaticKVCache
from rtc_agent.engine.stack import run_stack

from engine_helpers import engine_for


@pytest.mark.parametrize("count, masked", [(1, False), (1, True), (7, True), (32, True)])
def test_short_query_attention_equals_sdpa(count, masked):
    engine = engine_for(prefill_chunk_s=0)
    module = engine.model.thinker.model.language_model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, length, dim = 4, 2, 300, 16
    query = torch.randn(1, count, heads, dim, generator=gen).transpose(1, 2)  # laid out as the library's
    key, value = (torch.randn(1, kv_heads, length, dim, generator=gen) for _ in range(2))
    # causal over the last `count` of 217 filled positions; the rest of the buffer is empty
    queries = torch.arange(217 - count, 217)[:, None]
    mask = (torch.arange(length)[None] <= queries)[None, None] if masked else None
    ours, _ = attention.decode_attention(module, query, key, value, mask, scaling=dim ** -0.5)
    stock, _ = attention.sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    assert ours.shape == stock.shape == (1, count, heads, dim)
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
