"""Letter tasks from a built-in word list: count a letter (SpellingBee) or spell a word (SimpleSpelling).

After nanochat's `tasks/spellingbee.py`: a model that sees tokens, not letters, cannot count the
r's in "strawberry" by looking, so the answer spells the word out and then checks with the
calculator tool (`'strawberry'.count('r')`, which `flaxchat.tools.calculate` evaluates without a
sandbox) before it writes `#### 3`. SimpleSpelling teaches the spelling itself ("a-p-p-l-e").

Example i of (seed, split) is a pure function of those three values. The words are split, not just
the seeds: a word's split is fixed by a hash of the word (about 80% train, 10% val, 10% test), so a
val or test question is about a word that train never asks about.
"""

from __future__ import annotations

import functools
import re

from tasks.base import GeneratedTask, expand, extract_answer, numbers_equal, split_of


# ~450 common English words (nouns, verbs, adjectives; many from the built-in stories' vocabulary)
WORDS = tuple(dict.fromkeys("""
apple banana cherry grape lemon orange peach pear plum melon mango strawberry blueberry raspberry
tomato potato carrot onion pepper garlic pumpkin cabbage lettuce cucumber bread butter cheese
cookie cake candy honey sugar salt water juice milk coffee pizza pasta rice soup salad sandwich
breakfast lunch dinner kitchen spoon fork knife plate bowl cup bottle basket table chair sofa
window door floor ceiling wall garden flower tree grass leaf branch forest river mountain valley
ocean island beach desert meadow village city street bridge castle tower school library hospital
market station airport garage bakery farm barn field fence house cottage palace church museum
dog cat bird fish horse rabbit mouse turtle frog duck goose chicken sheep goat pig cow donkey
monkey tiger lion zebra giraffe elephant kangaroo penguin dolphin whale shark octopus squirrel
hedgehog owl eagle parrot butterfly spider ladybug bee snail worm dragon unicorn puppy kitten
mother father sister brother grandma grandpa uncle aunt cousin friend teacher doctor farmer baker
pilot sailor king queen prince princess wizard pirate robot giant monster fairy baby child
red blue green yellow purple brown black white pink silver golden
happy sad angry brave kind gentle quiet loud small little big tall short long round square soft
hard warm cold sunny rainy windy cloudy snowy bright dark early late quick slow funny silly clever
curious careful busy sleepy hungry thirsty tired strong proud shy friendly lucky special beautiful
wonderful terrible delicious dangerous different important
run walk jump swim climb dance sing play read write draw paint build cook bake clean sleep dream
laugh smile listen watch look find lose share help carry throw catch kick push pull open close
begin finish wait hurry remember forget imagine explore travel visit borrow return promise
whisper shout answer question
ball kite doll teddy puzzle balloon crayon pencil paper letter book story picture camera clock
watch lamp candle blanket pillow mirror ladder bucket shovel hammer rope wheel bicycle wagon
train truck rocket boat ship plane car bus tractor helicopter umbrella jacket sweater scarf
mitten glove boot shoe sock hat dress shirt pocket button ribbon necklace crown treasure map
key lock box bag backpack wallet coin money present party birthday holiday summer winter autumn
spring morning evening night today tomorrow yesterday week month year moment minute hour
sun moon star planet cloud rain snow storm thunder rainbow wind fire ice stone rock sand shell
feather nest egg seed root acorn mushroom pebble puddle
music song drum guitar piano violin trumpet whistle game team race prize secret surprise
adventure journey problem idea plan reason answer number word sentence picture color shape
circle triangle rectangle heart diamond
happiness kindness courage family people neighbor stranger visitor
beginning middle ending together always never sometimes often again almost enough
address bookkeeper committee balloon coffee mississippi success tennessee occasion necessary
accommodate embarrass parallel recommend millennium broccoli spaghetti banana strawberry
""".split()))

# a word's split, from a hash of the word (stable across processes, unlike `hash()`)
@functools.lru_cache(maxsize=None)
def words_of(split: str) -> tuple[str, ...]:
    return tuple(w for w in WORDS if split_of(w) == split)


class _WordTask(GeneratedTask):
    """Shared by the two letter tasks: the words of the split."""

    default_size = {"train": 5000, "val": 200, "test": 200}

    def __init__(self, split: str = "train", size: int | None = None, seed: int = 0,
                 start: int = 0, stop: int | None = None, step: int = 1):
        super().__init__(split, size, seed, start, stop, step)
        self.words = words_of(split)


# --- SpellingBee ---------------------------------------------------------------------------------

_QUOTES = ("'{}'", '"{}"', "{}")
_BEE_QUESTIONS = (
    "How many times does the letter {l} appear in {w}?",
    "How many {l}s are in {w}?",
    "How many {l}'s are there in the word {w}?",
    "How many times does {l} occur in {w}?",
    "Count the letter {l} in {w}[.|]",
    "Count how many times the letter {l} appears in the word {w}[.|]",
    "In the word {w}, how many times does the letter {l} appear?",
    "In {w}, how many {l}'s are there?",
    "What is the number of {l}'s in {w}?",
    "How often does the letter {l} show up in {w}?",
    "[Please tell me|Tell me|Can you tell me] how many times {l} appears in {w}[.|?]",
    "Does {w} have the letter {l}? How many times?",
    "how many {l} in {w}",
    "{w}: how many {l}'s?",
)
_BEE_INTROS = (
    "[We need|I need|We are asked] to count the letter '{l}' in the word '{w}'. ",
    "Let me count the letter '{l}' in '{w}'. ",
    "[We want|I want] the number of times '{l}' appears in '{w}'. ",
)
_BEE_ENDS = (
    "The letter '{l}' appears {n} {times} in '{w}'.",
    "So '{w}' has {n} '{l}'{plural}.",
    "There {are} {n} '{l}'{plural} in '{w}'.",
)


class SpellingBee(_WordTask):
    """How many times does a letter appear in a word? Answered by spelling, a `str.count` call, `#### n`."""

    name = "spelling"
    eval_type = "generative"

    def get_example(self, index: int) -> dict:
        rng = self.rng(index)
        word = rng.choice(self.words)
        # mostly a letter of the word; sometimes any letter, so that "0" is an answer too
        letter = rng.choice(word) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
        n = word.count(letter)
        upper = rng.random() < 0.1
        shown_letter = letter.upper() if upper else letter
        question = expand(rng.choice(_BEE_QUESTIONS), rng).format(
            l=rng.choice(_QUOTES).format(shown_letter), w=rng.choice(_QUOTES).format(word))
        if rng.random() < 0.2:
            question = question.lower()
        counted = ", ".join(f"{c}" if c != letter else f"{c}({i})" for c, i in _running(word, letter))
        fields = {"l": letter, "w": word, "n": n, "times": "time" if n == 1 else "times",
                  "plural": "" if n == 1 else "s", "are": "is" if n == 1 else "are"}
        intro = expand(rng.choice(_BEE_INTROS), rng).format(**fields)
        parts = [
            {"type": "text", "text": f"{intro}Spelled out with a running count of '{letter}': {counted}. "
                                     "Let me check with Python:\n"},
            {"type": "python", "text": f"'{word}'.count('{letter}')"},
            {"type": "python_output", "text": str(n)},
            {"type": "text", "text": "\n" + expand(rng.choice(_BEE_ENDS), rng).format(**fields) + f"\n#### {n}"},
        ]
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": parts}],
                "word": word, "letter": letter, "answer": str(n)}

    def evaluate(self, conversation: dict, response: str) -> bool:
        return numbers_equal(extract_answer(response), conversation["answer"])


def _running(word: str, letter: str):
    """(character, how many of `letter` so far) along the word."""
    seen = 0
    for c in word:
        seen += c == letter
        yield c, seen


# --- SimpleSpelling -------------------------------------------------------------------------------

_SPELL_QUESTIONS = (
    "Spell the word {w}[.|]",
    "How do you spell {w}?",
    "[Can|Could] you spell {w}[ for me|][?|]",
    "Spell {w} letter by letter[.|]",
    "[Please |]spell out {w}[.|]",
    "What are the letters in the word {w}?",
    "Write {w} one letter at a time[.|]",
    "spell {w}",
    "How is {w} spelled?",
    "Which letters make up the word {w}?",
    "{w}: spell it[ please|][.|]",
)
_SPELL_ANSWERS = ("{s}", "{W} is spelled {s}.", "It is spelled {s}.", "{w}: {s}", "The word {w} is spelled {s}.")
_SPELLED = re.compile(r"(?<![A-Za-z-])[A-Za-z](?:-[A-Za-z])+(?![A-Za-z-])")


class SimpleSpelling(_WordTask):
    """Spell a word: the answer writes it with hyphens between letters ("a-p-p-l-e")."""

    name = "spell"
    eval_type = "generative"

    def get_example(self, index: int) -> dict:
        rng = self.rng(index)
        word = rng.choice(self.words)
        question = expand(rng.choice(_SPELL_QUESTIONS), rng).format(w=rng.choice(_QUOTES).format(word))
        if rng.random() < 0.2:
            question = question[:1].upper() + question[1:]
        answer = expand(rng.choice(_SPELL_ANSWERS), rng).format(w=word, W=word.capitalize(), s="-".join(word))
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "word": word}

    def evaluate(self, conversation: dict, response: str) -> bool:
        """True when the last hyphen-spelled sequence in the reply is the word (any letter case)."""
        found = _SPELLED.findall(response)
        return bool(found) and found[-1].replace("-", "").lower() == conversation["word"]
