"""The model itself: the tiny or released configuration (tiny.py), loading and random or real weights (loader.py,
weights.py), the decoder stack (stack.py), the static KV cache (kv_cache.py), memory accounting (memory.py) and the
kernels that replace the library's (kernels/)."""
