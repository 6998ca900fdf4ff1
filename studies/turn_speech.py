"""The synthetic speech sets that turn-taking is tuned and measured on (studies/turn_latency.py,
studies/turn_tuning.py).

Four sets of different sentences, each with complete questions and sentences with a 600-1000 ms SSML <break> in
the middle (`tuning` and `unseen` also with finished requests with a comma inside): `tuning` (the semantic_vad
thresholds and check times were chosen on it), `heldout` (written before any score of it was seen, never used to
choose anything), `fresh` (written after the held-out sentences had been seen while the last-words check was
drafted) and `unseen` (written for the caller's-words check before any score of it was seen; what that check is
reported on).
Voice: espeak-ng's default English voice at its default rate. Other voices (en-us, en-gb-x-rp, en-us+f3) and a
comma or "..." before the break (a continuation tone) were tried on a few sentences and separated complete from
cut speech no better; Debian's archive here has no mbrola voices. flite's four voices (`voice="flite:slt"`...)
say the same sets for comparison: they separate no better either (docs/turn-taking.md).
"""
from __future__ import annotations

import functools
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rtc_agent.client.microphone import load_audio

LEVEL = 0.01  # |sample| above this is speech (espeak-ng's silence is exact zeros, flite's stays below 0.01)

QUESTIONS = {
    "tuning": [
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
    ],
    "heldout": [
        "Do you know a good place to buy shoes?",
        "What is the population of Canada?",
        "How do I make a cup of green tea?",
        "Can you translate this word into Spanish?",
        "When was the first moon landing?",
        "What is the fastest animal in the world?",
        "How many days are there in a leap year?",
        "Is the post office open on Sundays?",
        "What does a plumber charge for an hour?",
        "Could you spell the word necessary for me?",
        "Where can I park my car near the stadium?",
        "How old is the oldest tree on earth?",
        "Why do cats purr when they are happy?",
        "What is the best time to visit Japan?",
        "Can you tell me a joke about penguins?",
        "How do I get rid of a headache quickly?",
        "Which language has the most speakers?",
        "Will the shops be busy on Saturday morning?",
        "How much water should I drink every day?",
        "Who painted the ceiling of the Sistine Chapel?",
        "What is the difference between a frog and a toad?",
        "Should I take an umbrella with me today?",
    ],
    # Written before any score of it was seen, after the last-words check was built
    # (its word rule had been drafted with the sentences above in view): questions of other shapes, some ending
    # on a stranded preposition, a number or a name.
    "fresh": [
        "What is the tallest mountain in Africa?",
        "Where did you put the spare keys?",
        "How many people live in Tokyo?",
        "Can you wake me up at seven?",
        "What are you talking about?",
        "Is the swimming pool heated in winter?",
        "Who wrote the book about the white whale?",
        "How do I change a flat tyre?",
        "What should I pack for a weekend in Rome?",
        "Which team won the cup in nineteen ninety eight?",
        "Could you read me the news headlines?",
        "Where does this train go to?",
        "How hot is the surface of the sun?",
        "Do you have any ideas for a birthday party?",
        "What is a good name for a black cat?",
        "When is the next full moon?",
        "Why do onions make you cry?",
        "Can you turn the volume down a little?",
        "How long should I rest after a marathon?",
        "What is my calendar like on Friday?",
        "Is it safe to drink the tap water here?",
        "How do you pronounce the name Siobhan?",
    ],
    # Written for the caller's-words check (sentence_end.py) before any score of it was seen; never tuned on:
    # the held-out set that check is reported on, with its PAUSED and COMMAS sentences.
    "unseen": [
        "Why is the sky blue?",
        "Tell me a short joke about penguins.",
        "Can you describe what you see on my screen?",
        "What is two plus two?",
        "How far away is the moon?",
        "Who invented the telephone?",
        "What time is it in New York right now?",
        "Can you recommend a film for tonight?",
        "How do I make pancakes without milk?",
        "Is there a bank near the town hall?",
        "What does the word serendipity mean?",
        "Where was the last Olympic games held?",
        "Could you explain how vaccines work?",
        "How many legs does a spider have?",
        "What is the loudest animal on the planet?",
        "Do I need a visa to visit Brazil?",
        "Give me three ideas for a quick lunch.",
        "Which is bigger, a lion or a tiger?",
        "What should I say in a thank you card?",
        "How do I clean a cast iron pan?",
    ],
}

# (before the pause, pause in ms, after it): the sentence plainly goes on after the pause.
PAUSED = {
    "tuning": [
        ("I would like to book a table for", 800, "four people tonight."),
        ("Can you tell me how to get to", 700, "the central library?"),
        ("My favourite kind of music is", 900, "jazz from the fifties."),
        ("Please send a message to", 800, "my brother about dinner."),
        ("What is the best way to", 700, "learn a new language?"),
        ("I think the problem is that", 1000, "the printer has no paper."),
        ("Could you remind me to", 800, "water the plants tomorrow?"),
        ("The meeting has been moved to", 900, "Thursday afternoon."),
        ("How much does it cost to", 700, "fly to Berlin in May?"),
        ("I need to buy some", 800, "bread and milk on the way home."),
        ("Tell me a story about", 1000, "a dragon who loves cheese."),
        ("Is there a good restaurant near", 600, "the old harbour?"),
        ("We are planning a trip to", 900, "the mountains next week."),
        ("Can you find me a recipe for", 800, "chocolate cake without eggs?"),
        ("I was wondering whether", 1000, "you could help me with my homework."),
        ("Turn on the lights in", 700, "the living room please."),
        ("What do you know about", 800, "the history of Rome?"),
        ("My daughter wants to become", 900, "a veterinary surgeon."),
        ("Set an alarm for", 600, "seven thirty in the morning."),
        ("The train to London leaves from", 800, "platform number nine."),
    ],
    "heldout": [
        ("I am looking for a present for", 800, "my sister's birthday."),
        ("Could you explain how", 900, "a rainbow is formed?"),
        ("My car keeps making a noise when", 700, "I turn left."),
        ("I would love to hear about", 1000, "the history of jazz."),
        ("Can you check whether", 800, "the library is open today?"),
        ("We need to decide where to", 600, "go on holiday this summer."),
        ("The doctor told me to", 900, "drink more water."),
        ("What is the quickest way from", 700, "the hotel to the beach?"),
        ("I forgot to tell you that", 1000, "the party starts at eight."),
        ("Please add eggs and", 800, "butter to my shopping list."),
        ("How would you describe", 600, "the taste of coffee?"),
        ("My neighbour has a dog that", 900, "barks all night."),
        ("I want to learn how to", 800, "play the guitar."),
        ("Can you write a short poem about", 700, "the autumn leaves?"),
        ("The best thing about living here is", 1000, "the quiet streets."),
        ("Remind me tomorrow morning to", 800, "pay the electricity bill."),
        ("Is it true that", 600, "goldfish have short memories?"),
        ("I have been thinking about", 900, "changing my job."),
        ("Let me know when", 700, "the washing machine is done."),
        ("Could you find out if", 800, "my flight is delayed?"),
    ],
    # Written as its questions above: twelve pauses after a word no sentence ends with, and eight at a
    # phrase boundary where the words so far could be a whole sentence (people pause there too)
    "fresh": [
        ("I would like to order a pizza with", 800, "extra cheese and olives."),
        ("Can you book me a taxi to", 700, "the central station?"),
        ("The thing I miss most is", 900, "the sea in the morning."),
        ("Please call my wife and", 800, "tell her I am running late."),
        ("What is the weather going to be like in", 700, "Madrid this weekend?"),
        ("I really need a new pair of", 1000, "running shoes."),
        ("Could you tell me whether", 800, "the museum is open on Mondays?"),
        ("My brother is moving to", 900, "Canada next spring."),
        ("We should leave before", 600, "the traffic gets bad."),
        ("Can you add milk, bread and", 800, "a dozen eggs to the list?"),
        ("I forgot the name of the", 900, "restaurant we went to."),
        ("Is there anything good on", 700, "television tonight?"),
        ("Send a text to my sister", 800, "saying I will be there at six."),
        ("I want to watch a film", 900, "with lots of action in it."),
        ("Can you find a hotel", 700, "close to the beach in Nice?"),
        ("The kids are hungry", 800, "so let us stop for lunch soon."),
        ("Remind me to buy flowers", 1000, "for my mother's birthday."),
        ("Play some music", 600, "that I can dance to."),
        ("My phone battery is low", 900, "so keep the answer short."),
        ("Tell me about the weather", 800, "in Lisbon tomorrow afternoon."),
    ],
    "unseen": [
        ("Could you help me write a letter to", 800, "my landlord about the heating?"),
        ("I am trying to find a recipe that uses", 900, "leftover rice and eggs."),
        ("Can you give me directions to", 700, "the nearest hospital?"),
        ("I would like to reserve a table for", 1000, "two people at eight."),
        ("The main problem with my order is that it", 800, "never arrived."),
        ("Please remind me to pick up", 600, "the dry cleaning on Friday."),
        ("What is the difference between", 900, "a virus and a bacterium?"),
        ("My grandmother used to make", 700, "the best apple pie in town."),
        ("I need some advice about", 800, "buying a second hand car."),
        ("Can you navigate to", 1000, "the nearest charging station?"),
        ("Could you check if the", 600, "pharmacy is still open?"),
        ("We want to spend the weekend in", 900, "a quiet village by the sea."),
        ("I have been feeling tired", 800, "since I started the new job."),
        ("Turn the music down", 700, "while I am on the phone."),
        ("Let me think about it", 900, "and call you back later."),
        ("I would like a coffee", 600, "with a little oat milk."),
        ("Tell me something interesting", 1000, "about octopuses."),
        ("My laptop will not start", 800, "after the last update."),
        ("Book a room for Saturday", 700, "near the conference centre."),
        ("Read me the news", 900, "about the election results."),
    ],
}
# Finished requests with a comma inside (espeak-ng and flite say a short pause there): the turn must not end at it.
COMMAS = {
    "tuning": [
        "Hello, can you hear me?",
        "Excuse me, where is the nearest pharmacy?",
        "If it rains tomorrow, should I take the bus?",
        "Well, what do you think about my plan?",
        "First, tell me the weather in Rome.",
        "Please, turn off the kitchen lights.",
        "When you have a moment, read me my messages.",
        "Before we start, how long will this take?",
        "By the way, did you set the alarm?",
        "Honestly, I do not know what to cook tonight.",
        "On second thoughts, make it a large pizza.",
        "Apart from that, is there anything else I need?",
        "Sorry, could you say that again?",
        "In the morning, remind me to call the bank.",
        "Okay, play the next song.",
        "After dinner, what should we watch?",
        "As you know, my car is in the garage.",
        "Right, let us go through the list again.",
        "If you can, find me a cheaper flight.",
        "For my birthday, I would like a quiet dinner.",
    ],
    "unseen": [
        "Turn up the heating in the back seats, please.",
        "Hi, are you still there?",
        "Actually, I changed my mind about the hotel.",
        "If the shop is open, buy some bread.",
        "Now, what was I saying?",
        "Once the film ends, switch off the television.",
        "Listen, I need help with my tax return.",
        "Just in case, bring an extra jumper.",
        "Good morning, what is on my calendar today?",
        "To be honest, the last answer was wrong.",
        "When the kettle boils, let me know.",
        "Thanks, that was really helpful.",
        "If possible, keep the answer short.",
        "So, how does this work?",
        "Tomorrow morning, wake me up at seven.",
        "Yes, send the email to my boss.",
        "While you are at it, check the traffic.",
        "Oh dear, I forgot my keys again.",
        "Without sugar, how does the cake taste?",
        "In that case, cancel the order.",
    ],
}
SETS = tuple(QUESTIONS)


@dataclass
class Sentence:
    kind: str  # "question", "statement" or "paused"
    text: str
    samples: np.ndarray  # mono float32 at the rate asked for
    end: int  # last speech sample
    pause: tuple[int, int] | None  # the mid-sentence pause: first and last silent sample
    id: str = ""  # real speech (studies/real_speech.py): the clip's name
    voice: str = ""  # and who speaks


VOICES = ("espeak-ng", "flite:slt", "flite:rms", "flite:awb", "flite:kal16")  # flite: `apt-get install flite`


def espeak(text: str, rate: int, pause_ms: int | None = None, rest: str = "", continuation: bool = False
           ) -> np.ndarray:
    """`text`, or with `pause_ms` an SSML break and then `rest`; `continuation` puts a comma before the break
    (espeak-ng then says the words before it with its non-final, rising phrase tone instead of a plain stop)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.wav"
        if pause_ms is None:
            subprocess.run(["espeak-ng", "-w", str(path), text], check=True)
        else:
            ssml = f'<speak>{text}{"," if continuation else ""} <break time="{pause_ms}ms"/> {rest}</speak>'
            subprocess.run(["espeak-ng", "-m", "-w", str(path), ssml], check=True)
        return load_audio(str(path), rate)


def flite(voice: str, text: str, rate: int, pause_ms: int | None = None, rest: str = "",
          continuation: bool = False) -> np.ndarray:
    """As `espeak`, said by one of flite's voices. flite ignores SSML breaks, so a paused sentence is its two parts
    said one after the other with `pause_ms` of digital silence between them (the first part then ends as an
    utterance does; with `continuation`, on a comma)."""
    if pause_ms is None:
        return _flite(voice, text, rate)
    before = _flite(voice, text + ("," if continuation else ""), rate)
    before = before[:np.flatnonzero(np.abs(before) > LEVEL)[-1] + 1]
    return np.concatenate([before, np.zeros(rate * pause_ms // 1000, np.float32), _flite(voice, rest, rate)])


def _flite(voice: str, text: str, rate: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.wav"
        subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(path)], check=True)
        return load_audio(str(path), rate)


def speech_set(name: str, kinds: list[str], rate: int, continuation: bool = False, voice: str = "espeak-ng"
               ) -> list[Sentence]:
    """The sentences of set `name` (one of SETS), of the kinds asked for ("questions", "statements": the paused
    sentences said without their pause, "paused", "commas": COMMAS, where the set has them), said by `voice` (one
    of VOICES); `continuation`: the paused ones with a comma before their break (see `espeak`)."""
    if name not in QUESTIONS:
        raise ValueError(f"unknown speech set {name!r} (one of {', '.join(SETS)})")
    if voice not in VOICES:
        raise ValueError(f"unknown voice {voice!r} (one of {', '.join(VOICES)})")
    synthesize = espeak if voice == "espeak-ng" else functools.partial(flite, voice.split(":")[1])
    out = []
    if "questions" in kinds:
        for q in QUESTIONS[name]:
            s = synthesize(q, rate)
            out.append(Sentence("question", q, s, int(np.flatnonzero(np.abs(s) > LEVEL)[-1]), None))
    if "statements" in kinds:  # the paused sentences said whole: finished sentences that are not questions
        for before, _, after in PAUSED[name]:
            s = synthesize(f"{before} {after}", rate)
            out.append(Sentence("statement", f"{before} {after}", s, int(np.flatnonzero(np.abs(s) > LEVEL)[-1]), None))
    if "commas" in kinds:  # finished, with a short pause at a comma inside: a cut-in there is a turn ended early
        for text in COMMAS.get(name, []):
            s = synthesize(text, rate)
            out.append(Sentence("comma", text, s, int(np.flatnonzero(np.abs(s) > LEVEL)[-1]), None))
    if "paused" in kinds:
        for before, ms, after in PAUSED[name]:
            s = synthesize(before, rate, ms, after, continuation)
            loud = np.flatnonzero(np.abs(s) > LEVEL)
            i = int(np.argmax(np.diff(loud)))
            out.append(Sentence("paused", f"{before}{',' if continuation else ''} <{ms} ms> {after}", s, int(loud[-1]),
                                (int(loud[i]) + 1, int(loud[i + 1]) - 1)))
    return out
