"""The engine's own kernels, where the library's modules are many times slower for a decode step: the MoE
experts (`moe`), INT4 weights (`int4`), RMSNorm (`norm`), q/k norm + rotary + cache write (`rotary`), short-query
attention (`attention`). Each `install(model)` routes the library's modules through its fast path (`fast_path`);
on the CPU, and wherever a kernel does not apply, the library's own forward runs."""
