"""rtc-agent: a self-hosted real-time voice and video assistant on Qwen3-Omni."""
