"""Between processes: the typed records that cross the Unix socket (wire.py), the session interface defined once
(session_protocol.py), the engine process's side (host.py) and the media processes' side (remote.py)."""
