"""What the worker runs: the inputs encoded (audio_input.py, vision_input.py), the batched answer step (answer.py)
through the Talker (talker.py) and Code2Wav (code2wav.py), sampling, function calls' grammar (tools.py), the CUDA
graphs they replay (graphs.py) and the batched end-of-turn scorer (turn_scoring.py)."""
