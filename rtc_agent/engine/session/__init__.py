"""One call on the engine: the `Engine` and its `Session`s, the asyncio face that queues a call's work on the worker
(engine.py), and the call's model-side state, its history and the layout of its audio and video in time (context.py,
layout.py, caller_video.py)."""
