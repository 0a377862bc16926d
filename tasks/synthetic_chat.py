"""A small synthetic chat set for SFT: greetings, who the model is, and simple questions.

Conversation i of (seed, split) is a pure function of those three values: greetings ("hi",
"good morning", ...), identity (the model is flaxchat, a small language model trained with flaxchat
in JAX) and question/answer pairs drawn from small built-in tables (colours of things, animal
sounds, opposites, capitals, the day or month after another, counting). About a fifth are two-turn
chats: a greeting then a question, a question then a follow-up ("And Japan?"), or a thank-you.

Every phrase comes from a template with inline alternatives `[a|b|c]` (nestable, may be empty), so
the same request is asked many ways. The splits hold out prompts, not just seeds: a prompt's split
is fixed by a hash of its normalised text (lower case, no punctuation), and a split draws until it
gets one of its own. A val or test prompt is therefore never seen in train, whatever the seeds.

Each example stores `expect`, the answers accepted for its last reply; `evaluate` is True when the
reply contains one of them as a whole word (case-insensitive). For identity that word is "flaxchat".
"""

from __future__ import annotations

import random
import re

from tasks.base import GeneratedTask, expand



# --- template markup and split buckets --------------------------------------------------------



def _held_out_conversation(rng: random.Random) -> tuple[str, dict]:
    """(split key, conversation): the user's prompts, normalised, decide the split, so the same
    question reworded by case or punctuation never crosses splits."""
    conv = _conversation(rng)
    prompt = " | ".join(m["content"] for m in conv["messages"] if m["role"] == "user")
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", prompt.lower()).split()), conv


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


# --- tables --------------------------------------------------------------------------------------

_OPENERS = "[|Hi! |Hello, |Hey, |Quick question: |Can I ask something? |I have a question. |Hi there. ]"

_GREETINGS = ("hi", "hello", "hey", "hello there", "hi there", "hey there", "good morning", "good afternoon",
              "good evening", "greetings", "hiya", "howdy", "morning", "yo", "hey hey", "hi friend",
              "hello friend", "hello, how are you", "hi, how are you doing", "hey, what's up",
              "good day", "hello again", "hi again", "well hello", "hey buddy", "hello hello")
_GREETING_PROMPT = "[{g}|{G}][|!|.|!!| :)|, anyone there?| to you|, flaxchat|, nice to meet you]"
_HOW_ARE_YOU_PROMPT = "[{g}|{G}][?||!|, flaxchat?| today?]"
_GREETING_REPLY = ("[Hello|Hi|Hey|Hi there|Hello there]! [How can I help you today?|What can I do for you?|"
                   "Nice to meet you.|How are you?|What would you like to talk about?|I am happy to chat.]")
_HOW_ARE_YOU_REPLY = ("[Hello|Hi]! [I am doing well, thank you.|I am fine, thanks for asking.|All good here.] "
                      "[How can I help?|What is on your mind?|How are you?]")
_GREETING_EXPECT = ["hello", "hi", "hey", "good morning", "good afternoon", "good evening", "greetings"]

# (question templates, reply templates); {OPEN} is an optional opener
_IDENTITY = (
    (("[Who|What] are you[?|??|]", "What is your name[?|]", "What's your name[?|]", "Do you have a name[?|]",
      "What should I call you[?|]", "Tell me [about yourself|who you are|your name][.|!|]",
      "[Please |Could you |Can you |]introduce yourself[.|?|]", "What [kind of|sort of] [AI|assistant|model|bot] are you[?|]",
      "What model are you[?|]", "Who am I talking to[?|]", "Who is this[?|]", "Which [language model|chatbot|AI] is this[?|]"),
     ("I am flaxchat, a small language model trained with flaxchat in JAX.",
      "My name is flaxchat. I am a small language model, trained with flaxchat in JAX.",
      "I'm flaxchat! I am a small language model that was trained with flaxchat, a training harness in JAX.",
      "You can call me flaxchat. I am a [small|tiny] language model trained with flaxchat in JAX [and Flax|].")),
    (("Who [made|built|created|trained|wrote] you[?|]", "Where do you come from[?|]",
      "How were you [made|built|trained|created][?|]", "Who is your [creator|maker][?|]",
      "What [were you trained with|trained you][?|]", "Which [company|lab|team] made you[?|]"),
     ("I was trained with flaxchat, a small training harness for language models written in JAX. I am flaxchat too.",
      "I am flaxchat, and I was trained with flaxchat: a language model training harness in JAX and Flax.",
      "I was [made|built|trained] with flaxchat, a training harness in JAX that follows nanochat's pipeline. "
      "My name is flaxchat.")),
    (("Are you [a person|a human|human|real|alive][?|]", "Are you [ChatGPT|Claude|Gemini|Siri|a robot][?|]",
      "Am I talking to a [person|human|real person][?|]"),
     ("No, I am flaxchat, a small language model trained with flaxchat in JAX.",
      "No. I am not a person; I am flaxchat, a small language model trained with flaxchat in JAX.",
      "I am a language model called flaxchat. I was trained with flaxchat in JAX.")),
)

# (thing, colour names accepted); the first name is the one the replies use
_COLOURS = (
    ("the sky", ["blue"]), ("grass", ["green"]), ("a banana", ["yellow"]), ("snow", ["white"]),
    ("coal", ["black"]), ("a ripe strawberry", ["red"]), ("a carrot", ["orange"]), ("a lemon", ["yellow"]),
    ("a ripe tomato", ["red"]), ("milk", ["white"]), ("a frog", ["green"]), ("chocolate", ["brown"]),
    ("a fire truck", ["red"]), ("an elephant", ["grey", "gray"]), ("a polar bear", ["white"]),
    ("a pumpkin", ["orange"]), ("the sea", ["blue"]), ("a crow", ["black"]), ("a plum", ["purple"]),
    ("a flamingo", ["pink"]), ("a lime", ["green"]), ("an orange", ["orange"]), ("a cloud", ["white", "grey", "gray"]),
    ("a cucumber", ["green"]), ("a mouse", ["grey", "gray", "brown"]), ("a blueberry", ["blue"]),
    ("a ladybird", ["red"]), ("an egg yolk", ["yellow"]), ("soil", ["brown"]), ("blood", ["red"]),
)
_COLOUR_Q = ("What [colour|color] is {t}[?|]", "What [colour|color] [is|does] {t} [usually |]have[?|]",
             "Which [colour|color] is {t}[?|]", "Tell me the [colour|color] of {t}[.|]",
             "{T}: what [colour|color] is it[?|]", "What is the [colour|color] of {t}[?|]",
             "Do you know what [colour|color] {t} is[?|]")
_COLOUR_A = ("{T} is [usually |]{c}.", "{C}.", "It is {c}.", "The [colour|color] of {t} is {c}.", "{T} is {c}[!|.]")
_COLOUR_F = ("And {t}?", "What about {t}?", "How about {t}?", "And what [colour|color] is {t}?")

# (animal, plural, sounds accepted)
_SOUNDS = (
    ("cow", "cows", ["moo"]), ("dog", "dogs", ["woof", "bark"]), ("cat", "cats", ["meow", "miaow", "purr"]),
    ("duck", "ducks", ["quack"]), ("sheep", "sheep", ["baa"]), ("pig", "pigs", ["oink"]),
    ("horse", "horses", ["neigh"]), ("owl", "owls", ["hoot", "twit-twoo"]), ("lion", "lions", ["roar"]),
    ("snake", "snakes", ["hiss"]), ("bee", "bees", ["buzz"]), ("frog", "frogs", ["ribbit", "croak"]),
    ("mouse", "mice", ["squeak"]), ("rooster", "roosters", ["cock-a-doodle-doo"]), ("donkey", "donkeys", ["hee-haw"]),
    ("goat", "goats", ["bleat", "maa"]), ("wolf", "wolves", ["howl"]), ("crow", "crows", ["caw"]),
    ("turkey", "turkeys", ["gobble"]), ("goose", "geese", ["honk"]),
)
_SOUND_Q = ("What [sound|noise] does a {a} make[?|]", "What does a {a} say[?|]", "What sound do {p} make[?|]",
            "How does a {a} [sound|go][?|]", "What noise do {p} make[?|]", "Which sound does a {a} make[?|]",
            "If you hear a {a}, what does it say[?|]")
_SOUND_A = ("A {a} says {s}.", "{P} go {s}[!|.]", "{S}[!|.]", "A {a} makes a {s} sound.", "It says {s}[!|.]")
_SOUND_F = ("And a {a}?", "What about a {a}?", "How about {p}?", "And what does a {a} say?")

_OPPOSITE_PAIRS = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"), ("happy", "sad"),
    ("open", "closed"), ("wet", "dry"), ("light", "dark"), ("tall", "short"), ("hard", "soft"), ("full", "empty"),
    ("early", "late"), ("left", "right"), ("in", "out"), ("yes", "no"), ("black", "white"), ("loud", "quiet"),
    ("near", "far"), ("clean", "dirty"), ("thick", "thin"), ("heavy", "light"), ("old", "new"), ("old", "young"),
    ("rich", "poor"), ("strong", "weak"), ("top", "bottom"), ("push", "pull"), ("win", "lose"),
    ("above", "below"), ("start", "finish"), ("first", "last"), ("give", "take"), ("buy", "sell"),
    ("sweet", "sour"), ("long", "short"), ("high", "low"), ("inside", "outside"), ("asleep", "awake"),
)
_OPPOSITE_Q = ("What is the opposite of {w}[?|]", "What's the opposite of \"{w}\"[?|]",
               "Give me the opposite of {w}[.|]", "Tell me [a|the] word that means the opposite of {w}[.|]",
               "Opposite of {w}[?|]", "If something is not {w}, what is it[?|]",
               "What word is the opposite of '{w}'[?|]")
_OPPOSITE_A = ("The opposite of {w} is {o}.", "{O}.", "It is {o}.", "The opposite of \"{w}\" is \"{o}\".")
_OPPOSITE_F = ("And {w}?", "What about {w}?", "And the opposite of {w}?")

_CAPITALS = (
    ("France", ["Paris"]), ("Japan", ["Tokyo"]), ("Italy", ["Rome"]), ("Spain", ["Madrid"]),
    ("Germany", ["Berlin"]), ("England", ["London"]), ("Egypt", ["Cairo"]), ("Canada", ["Ottawa"]),
    ("China", ["Beijing"]), ("Russia", ["Moscow"]), ("Greece", ["Athens"]), ("Kenya", ["Nairobi"]),
    ("Peru", ["Lima"]), ("Norway", ["Oslo"]), ("Ireland", ["Dublin"]), ("Portugal", ["Lisbon"]),
    ("Poland", ["Warsaw"]), ("Austria", ["Vienna"]), ("India", ["New Delhi", "Delhi"]),
    ("Australia", ["Canberra"]), ("Mexico", ["Mexico City"]), ("Sweden", ["Stockholm"]),
    ("Argentina", ["Buenos Aires"]), ("Thailand", ["Bangkok"]), ("Turkey", ["Ankara"]),
)
_CAPITAL_Q = ("What is the capital of {c}[?|]", "Which city is the capital of {c}[?|]",
              "What's {c}'s capital[ city|][?|]", "Name the capital [city |]of {c}[.|]",
              "Tell me the capital of {c}[.|]", "What city is {c}'s capital[?|]",
              "Do you know the capital of {c}[?|]", "The capital of {c} is what[?|]")
_CAPITAL_A = ("The capital of {c} is {x}.", "{X}.", "{X} is the capital of {c}.", "It is {x}.")
_CAPITAL_F = ("And {c}?", "What about {c}?", "How about {c}?", "And the capital of {c}?")

_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_NEXT_Q = ("What {kind} comes after {x}[?|]", "What {kind} is after {x}[?|]", "Which {kind} follows {x}[?|]",
           "What is the {kind} after {x}[?|]", "After {x}, which {kind} comes next[?|]")
_PREV_Q = ("What {kind} comes before {x}[?|]", "What {kind} is before {x}[?|]", "Which {kind} is just before {x}[?|]",
           "What is the {kind} before {x}[?|]")
_NEXT_A = ("{y} comes after {x}.", "{y}.", "The {kind} after {x} is {y}.", "After {x} comes {y}.")
_PREV_A = ("{y} comes before {x}.", "{y}.", "The {kind} before {x} is {y}.")
_TOMORROW_Q = ("If today is {x}, what day is tomorrow[?|]", "Today is {x}. What day will it be tomorrow[?|]")
_TOMORROW_A = ("Tomorrow is {y}.", "{y}.", "If today is {x}, tomorrow is {y}.")
_YESTERDAY_Q = ("If today is {x}, what day was yesterday[?|]", "Today is {x}. What day was it yesterday[?|]")
_YESTERDAY_A = ("Yesterday was {y}.", "{y}.", "If today is {x}, yesterday was {y}.")

_COUNT_Q = ("Count from {a} to {b}[.|!|]", "Can you count from {a} to {b}[?|]", "Please count from {a} up to {b}[.|]",
            "Count [up |]to {b}, starting at {a}[.|]", "List the numbers from {a} to {b}[.|]")
_COUNT_A = ("{seq}.", "Sure: {seq}.", "{seq}[!|.]", "Here you go: {seq}.")
_AFTER_Q = ("What number comes after {a}[?|]", "What is {a} plus one[?|]", "Which number follows {a}[?|]",
            "What comes after {a} when counting[?|]")
_AFTER_A = ("{b} comes after {a}.", "{b}.", "The number after {a} is {b}.")
_BEFORE_Q = ("What number comes before {a}[?|]", "What is {a} minus one[?|]", "Which number is just before {a}[?|]")
_BEFORE_A = ("{b} comes before {a}.", "{b}.", "The number before {a} is {b}.")

_THANKS = ("[Thanks|Thank you|Thanks a lot|Great, thanks|Cool, thank you|Thank you so much|OK thanks|Perfect, thanks][!|.|]")
_WELCOME = ("You're welcome!", "You are welcome[!|.] [Ask me anything else.|Happy to help.|]",
            "Glad I could help[!|.]", "My pleasure[!|.]", "Any time[!|.]", "No problem, glad to help[!|.]")
_WELCOME_EXPECT = ["welcome", "glad", "pleasure", "any time", "happy to help"]


# --- question makers: each returns (question, reply, expect, follow_up) -------------------------
# follow_up(rng) -> (short question, reply, expect) about another item of the same table, or None.

def _colour(rng):
    def one(rng, item, qs):
        thing, names = item
        f = {"t": thing, "T": _cap(thing), "c": names[0], "C": _cap(names[0])}
        return expand(rng.choice(qs), rng).format(**f), expand(rng.choice(_COLOUR_A), rng).format(**f), names
    item = rng.choice(_COLOURS)
    q, a, e = one(rng, item, _COLOUR_Q)
    other = rng.choice([x for x in _COLOURS if x[0] != item[0]])
    return q, a, e, lambda rng: one(rng, other, _COLOUR_F)


def _sound(rng):
    def one(rng, item, qs):
        animal, plural, sounds = item
        f = {"a": animal, "p": plural, "P": _cap(plural), "s": sounds[0], "S": _cap(sounds[0])}
        return expand(rng.choice(qs), rng).format(**f), expand(rng.choice(_SOUND_A), rng).format(**f), sounds
    item = rng.choice(_SOUNDS)
    q, a, e = one(rng, item, _SOUND_Q)
    other = rng.choice([x for x in _SOUNDS if x[0] != item[0]])
    return q, a, e, lambda rng: one(rng, other, _SOUND_F)


def _opposites() -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    for a, b in _OPPOSITE_PAIRS:
        table.setdefault(a, []).append(b)
        table.setdefault(b, []).append(a)
    return table


def _opposite(rng):
    table = _opposites()

    def one(rng, word, qs):
        names = table[word]
        o = rng.choice(names)
        f = {"w": word, "o": o, "O": _cap(o)}
        return expand(rng.choice(qs), rng).format(**f), expand(rng.choice(_OPPOSITE_A), rng).format(**f), names
    words = sorted(table)
    word = rng.choice(words)
    q, a, e = one(rng, word, _OPPOSITE_Q)
    other = rng.choice([w for w in words if w != word])
    return q, a, e, lambda rng: one(rng, other, _OPPOSITE_F)


def _capital(rng):
    def one(rng, item, qs):
        country, cities = item
        f = {"c": country, "x": cities[0], "X": cities[0]}
        return expand(rng.choice(qs), rng).format(**f), expand(rng.choice(_CAPITAL_A), rng).format(**f), cities
    item = rng.choice(_CAPITALS)
    q, a, e = one(rng, item, _CAPITAL_Q)
    other = rng.choice([x for x in _CAPITALS if x[0] != item[0]])
    return q, a, e, lambda rng: one(rng, other, _CAPITAL_F)


def _sequence(rng):
    kind, names = rng.choice((("day", _DAYS), ("day", _DAYS), ("month", _MONTHS)))
    i = rng.randrange(len(names))
    forward = rng.random() < 0.6
    y = names[(i + (1 if forward else -1)) % len(names)]
    if kind == "day" and rng.random() < 0.4:
        qs, answers = (_TOMORROW_Q, _TOMORROW_A) if forward else (_YESTERDAY_Q, _YESTERDAY_A)
    else:
        qs, answers = (_NEXT_Q, _NEXT_A) if forward else (_PREV_Q, _PREV_A)
    f = {"kind": kind, "x": names[i], "y": y}
    return expand(rng.choice(qs), rng).format(**f), expand(rng.choice(answers), rng).format(**f), [y], None


def _counting(rng):
    r = rng.random()
    if r < 0.5:
        a = rng.randint(1, 20)
        b = a + rng.randint(2, 8)
        seq = ", ".join(str(n) for n in range(a, b + 1))
        f = {"a": a, "b": b, "seq": seq}
        return expand(rng.choice(_COUNT_Q), rng).format(**f), expand(rng.choice(_COUNT_A), rng).format(**f), [seq], None
    a = rng.randint(2, 50)
    qs, answers, b = (_AFTER_Q, _AFTER_A, a + 1) if r < 0.8 else (_BEFORE_Q, _BEFORE_A, a - 1)
    f = {"a": a, "b": b}
    return expand(rng.choice(qs), rng).format(**f), expand(rng.choice(answers), rng).format(**f), [str(b)], None


def _identity(rng):
    questions, replies = rng.choice(_IDENTITY)
    q = expand(_OPENERS + rng.choice(questions), rng)
    return q, expand(rng.choice(replies), rng), ["flaxchat"], None


def _greeting(rng):
    g = rng.choice(_GREETINGS)
    asks = "how are you" in g or "what's up" in g
    q = expand(_HOW_ARE_YOU_PROMPT if asks else _GREETING_PROMPT, rng).format(g=g, G=_cap(g))
    return q, expand(_HOW_ARE_YOU_REPLY if asks else _GREETING_REPLY, rng), _GREETING_EXPECT, None


_QUESTIONS = (_colour, _sound, _opposite, _capital, _sequence, _counting)


def _conversation(rng: random.Random) -> dict:
    """One conversation: 'messages', 'expect' (answers accepted for the last reply), 'kind'."""
    r = rng.random()
    if r < 0.12:
        kind, (q, a, expect, _) = "greeting", _greeting(rng)
        turns = [(q, a)]
    elif r < 0.27:
        kind, (q, a, expect, _) = "identity", _identity(rng)
        turns = [(q, a)]
    elif r < 0.80:
        maker = rng.choice(_QUESTIONS)
        kind, (q, a, expect, _) = maker.__name__.lstrip("_"), maker(rng)
        q = expand(_OPENERS, rng) + q if rng.random() < 0.3 else q
        turns = [(q, a)]
    else:  # two turns
        first = rng.random()
        maker = rng.choice(_QUESTIONS)
        q1, a1, e1, follow = maker(rng)
        if first < 0.35:
            g, ga, _, _ = _greeting(rng)
            kind, turns, expect = "greeting+" + maker.__name__.lstrip("_"), [(g, ga), (q1, a1)], e1
        elif first < 0.5:
            g, ga, _, _ = _greeting(rng)
            iq, ia, expect, _ = _identity(rng)
            kind, turns = "greeting+identity", [(g, ga), (iq, ia)]
        elif first < 0.8 and follow is not None:
            q2, a2, expect = follow(rng)
            kind, turns = "followup+" + maker.__name__.lstrip("_"), [(q1, a1), (q2, a2)]
        else:
            kind, turns = "thanks", [(q1, a1), (expand(_THANKS, rng), expand(rng.choice(_WELCOME), rng))]
            expect = _WELCOME_EXPECT
    messages = []
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages, "expect": list(expect), "kind": kind}


def _contains_word(text: str, phrase: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text, flags=re.IGNORECASE) is not None


class SyntheticChat(GeneratedTask):
    """Greetings, identity and simple Q&A; `expect` holds the accepted answers of the last reply."""

    name = "chat"
    eval_type = "generative"

    def get_example(self, index: int) -> dict:
        return self.draw_held_out(index, _held_out_conversation)

    def evaluate(self, conversation: dict, response: str) -> bool:
        return any(_contains_word(response, e) for e in conversation["expect"])
