"""The one CUDA worker thread and what it schedules: rounds of every call's queued work and the batched step that
advances every answer (worker.py), over the session slots, one row of the batched KV caches each (slots.py)."""
