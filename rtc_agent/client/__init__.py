"""aiortc clients of the call server: `rtc-agent call` (a WAV as the microphone) and `rtc-agent talk` (live)."""
