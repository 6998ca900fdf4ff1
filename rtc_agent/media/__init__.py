"""WebRTC media: caller audio in (+ VAD), caller video in (2 fps), the agent's 80 ms Opus packets out."""
