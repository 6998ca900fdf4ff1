"""The espeak-ng speech set of the turn-taking measurement (scripts/turn_latency.py) and its tests."""
from __future__ import annotations

import subprocess
from pathlib import Path

QUESTIONS = [
    "What is the weather like in Paris tomorrow?",
    "How far is it from here to the train station?",
    "Can you recommend a good book about history?",
    "What time does the pharmacy close today?",
    "How do I reset the password on my laptop?",
    "Who won the football match last night?",
    "What is the capital city of Australia?",
    "Could you set a timer for ten minutes?",
    "How many grams of sugar are in a teaspoon?",
    "Where is the nearest petrol station?",
    "What should I cook for dinner tonight?",
    "Is it going to rain this afternoon?",
    "How long does it take to boil an egg?",
    "Can you play some relaxing music for me?",
    "What is the exchange rate between euros and dollars?",
    "When does the next bus to the airport leave?",
    "How do you say thank you in Japanese?",
    "Why is the sky blue during the day?",
    "What are the opening hours of the museum?",
    "Could you remind me to call my mother at six?",
    "How tall is the Eiffel Tower?",
    "Which planet is closest to the sun?",
]

# A pause in the middle of a sentence, where the sentence is plainly not over yet.
PAUSED = [
    ("I would like to book a table for", "four people tonight.", 800),
    ("Can you tell me how to get to", "the central library?", 700),
    ("My favourite kind of music is", "jazz from the fifties.", 900),
    ("Please send a message to", "my brother about dinner.", 800),
    ("What is the best way to", "learn a new language?", 700),
    ("I think the problem is that", "the printer has no paper.", 1000),
    ("Could you remind me to", "water the plants tomorrow?", 800),
    ("The meeting has been moved to", "Thursday afternoon.", 900),
    ("How much does it cost to", "fly to Berlin in May?", 700),
    ("I need to buy some", "bread and milk on the way home.", 800),
    ("Tell me a story about", "a dragon who loves cheese.", 1000),
    ("Is there a good restaurant near", "the old harbour?", 600),
    ("We are planning a trip to", "the mountains next week.", 900),
    ("Can you find me a recipe for", "chocolate cake without eggs?", 800),
    ("I was wondering whether", "you could help me with my homework.", 1000),
    ("Turn on the lights in", "the living room please.", 700),
    ("What do you know about", "the history of Rome?", 800),
    ("My daughter wants to become", "a veterinary surgeon.", 900),
    ("Set an alarm for", "seven thirty in the morning.", 600),
    ("The train to London leaves from", "platform number nine.", 800),
]


def say(text: str, path: Path, pause_ms: int | None = None, rest: str = "") -> Path:
    """espeak-ng's voice saying `text` (and, after an SSML break of `pause_ms`, `rest`) into a WAV."""
    if pause_ms is None:
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True)
    else:
        ssml = f'<speak>{text} <break time="{pause_ms}ms"/> {rest}</speak>'
        subprocess.run(["espeak-ng", "-m", "-w", str(path), ssml], check=True)
    return path
