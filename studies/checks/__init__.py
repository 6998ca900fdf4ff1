"""GPU checks run by hand on a device machine (`python -m studies.checks.NAME`): the fast path's answer
against the eager one (`fast_path`), INT4 quality and tiles (`int4`), the MoE and RMSNorm kernels against the
library and their tile sweeps (`moe`, `norm`). They use the engine; the engine never imports them."""
