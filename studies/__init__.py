"""Studies and device runs: how the figures in docs/ were measured, kept runnable and outside the wheel.

Run them from the repository root, as modules (`python3 -m studies.turn_latency ...`, `python3 -m
studies.checks.fast_path ...`) or the device_*.sh scripts with `bash studies/device_NAME.sh`; each file's docstring
or header says what it measures. The product never imports them.
"""
