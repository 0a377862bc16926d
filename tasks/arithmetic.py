"""GSM8K-shaped word problems small enough for a tiny model: one or two operations on numbers < 100.

Each problem is a story template (buying things, sharing sweets, ages, pages read, coins, a train,
a bus, a garden, cookies, eggs, savings, legs on a farm, ...) filled with random names, objects and
numbers chosen so that every intermediate and final result is a non-negative integer. The solution
is rendered the way nanochat renders GSM8K: a sentence of reasoning, a calculator call holding the
whole expression (`3*4+5`), its output, then a sentence with the result and `#### <answer>`.
Division is written `//` so the calculator prints `6`, not `6.0`, and the model copies an integer.

Problem i of (seed, split) is a pure function of those three values. The splits hold out problems,
not just seeds: a problem's split is fixed by a hash of its template and numbers (names and wording
left out), about 80% train, 10% val, 10% test, and a split draws until it gets one of its own. So no
val or test question appears in train, even reworded or with other names, whatever the seeds.
"""

from __future__ import annotations

import random

from tasks.base import GeneratedTask, expand, extract_answer, numbers_equal


_NAMES = (("Mia", "she", "her"), ("Tom", "he", "his"), ("Lily", "she", "her"), ("Ben", "he", "his"),
          ("Sara", "she", "her"), ("Omar", "he", "his"), ("Zoe", "she", "her"), ("Leo", "he", "his"),
          ("Anna", "she", "her"), ("Sam", "he", "his"), ("Ruby", "she", "her"), ("Max", "he", "his"),
          ("Priya", "she", "her"), ("Kai", "he", "his"), ("Emma", "she", "her"), ("Jamal", "he", "his"),
          ("Lucy", "she", "her"), ("Finn", "he", "his"), ("Nora", "she", "her"), ("Hugo", "he", "his"),
          ("Mei", "she", "her"), ("Ravi", "he", "his"), ("Ella", "she", "her"), ("Noah", "he", "his"))
_SHOP_ITEMS = ("apple", "pencil", "notebook", "toy car", "balloon", "sticker", "comic book", "cupcake",
               "marker", "yo-yo", "kite", "muffin", "postcard", "hair clip", "bracelet")
_SWEETS = ("sweets", "candies", "stickers", "marbles", "grapes", "crayons", "cards", "strawberries", "nuts")
_FLOWERS = ("tulip", "rose", "daisy", "sunflower", "carrot", "cabbage", "lettuce", "bean plant")
_SPENDS = ("a snack", "a comic", "a toy", "a drink", "a game", "a book")
_COLLECTIONS = ("marbles", "stickers", "shells", "stamps", "cards", "pebbles", "buttons", "beads")


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


# --- story templates ------------------------------------------------------------------------------
# Numbers and answers stay below 100 (at most two digits for the model to copy); every result is a
# non-negative integer by construction (a subtraction draws its second number up to the first).
# Each takes (rng, f) where f already has the people {N},{he},{his},{He} and {M} (another name), adds
# its objects and numbers to f, and returns (numbers, question, reason, expression, answer, result
# sentence). The numbers tuple, with the template's index, decides the split.

def _buy(rng, f):
    a, b = rng.randint(2, 9), rng.randint(2, 11)
    f.update(a=a, b=b, items=_plural(rng.choice(_SHOP_ITEMS)))
    q = ("{N} buys {a} {items} that cost {b} dollars each. How [much money|many dollars] does {N} spend[ in total|]?"
         if rng.random() < 0.5 else "[At the shop, |]{a} {items} cost {b} dollars each. {N} buys all {a}. "
         "How much does {he} pay?")
    return (a, b), q, "Each costs {b} dollars and {N} buys {a}, so we multiply.", f"{a}*{b}", a * b, \
        "{N} spends {ans} dollars."


def _change(rng, f):
    a, b = rng.randint(2, 6), rng.randint(2, 9)
    c = rng.randint(max(a * b, 10), 99)
    f.update(a=a, b=b, c=c, items=_plural(rng.choice(_SHOP_ITEMS)))
    q = "{N} has {c} dollars. {He} buys {a} {items} for {b} dollars each. How many dollars does {N} have left?"
    return (a, b, c), q, "The {items} cost {a} times {b} dollars, which we take away from {c}.", \
        f"{c}-{a}*{b}", c - a * b, "{N} has {ans} dollars left."


def _share(rng, f):
    b, each = rng.randint(2, 9), rng.randint(2, 11)
    total = b * each  # at most 9*11 = 99
    f.update(b=b, t=total, things=rng.choice(_SWEETS))
    q = ("{N} has {t} {things} and shares them equally [among|between] {b} friends. "
         "How many {things} does each friend get?")
    return (b, total), q, "We divide the {t} {things} equally into {b} groups.", f"{total}//{b}", total // b, \
        "Each friend gets {ans} {things}."


def _older(rng, f):
    a, b = rng.randint(3, 60), rng.randint(1, 30)
    f.update(a=a, b=b)
    q = "{N} is {a} years old. {M} is {b} years older than {N}. How old is {M}?"
    return (a, b), q, "{M} is {b} years older, so we add {b} to {a}.", f"{a}+{b}", a + b, "{M} is {ans} years old."


def _younger_later(rng, f):
    a = rng.randint(8, 60)
    b, c = rng.randint(1, a - 1), rng.randint(1, 20)
    f.update(a=a, b=b, c=c)
    q = "{N} is {a} years old and {M} is {b} years younger. How old will {M} be in {c} years?"
    return (a, b, c), q, "{M} is {b} years younger than {a} now, and {c} more years will pass.", f"{a}-{b}+{c}", \
        a - b + c, "{M} will be {ans} years old."


def _pages(rng, f):
    d = rng.randint(2, 7)
    a = rng.randint(3, 99 // d)
    f.update(a=a, d=d)
    q = "{N} reads {a} pages [of a book |]every day. How many pages does {he} read in {d} days?"
    return (a, d), q, "{N} reads {a} pages on each of {d} days.", f"{a}*{d}", a * d, "{N} reads {ans} pages."


def _pages_left(rng, f):
    a, d = rng.randint(3, 12), rng.randint(2, 7)
    c = rng.randint(a * d + 1, 99)
    f.update(a=a, d=d, c=c)
    q = "A book has {c} pages. {N} reads {a} pages a day for {d} days. How many pages are left to read?"
    return (a, d, c), q, "{N} has read {a} times {d} pages, which we take away from {c}.", f"{c}-{a}*{d}", \
        c - a * d, "There are {ans} pages left."


def _coins(rng, f):
    a, b = rng.randint(5, 60), rng.randint(1, 30)
    c = rng.randint(1, a + b)
    f.update(a=a, b=b, c=c, thing=rng.choice(_SPENDS))
    q = ("{N} has {a} coins. {He} finds {b} more coins and then spends {c} coins on {thing}. "
         "How many coins does {N} have now?")
    return (a, b, c), q, "{N} gains {b} coins and loses {c}.", f"{a}+{b}-{c}", a + b - c, "{N} has {ans} coins now."


def _train(rng, f):
    a, b = rng.randint(2, 8), rng.randint(3, 12)
    c = rng.randint(1, a * b)
    f.update(a=a, b=b, c=c)
    q = ("A train has {a} [cars|carriages] with {b} passengers in each. At the next station {c} passengers "
         "get off. How many passengers are still on the train?")
    return (a, b, c), q, "There were {a} times {b} passengers, then {c} got off.", f"{a}*{b}-{c}", a * b - c, \
        "{ans} passengers are still on the train."


def _bus(rng, f):
    a, b = rng.randint(5, 50), rng.randint(1, 30)
    c = rng.randint(1, a + b)
    f.update(a=a, b=b, c=c)
    q = ("There are {a} people on a bus. At the [first |next |]stop {b} people get on and {c} people get off. "
         "How many people are on the bus now?")
    return (a, b, c), q, "{b} people got on and {c} got off.", f"{a}+{b}-{c}", a + b - c, \
        "There are {ans} people on the bus now."


def _garden(rng, f):
    a, b = rng.randint(2, 9), rng.randint(2, 11)
    f.update(a=a, b=b, plants=_plural(rng.choice(_FLOWERS)))
    q = "{N} plants {a} rows of {plants} with {b} {plants} in each row. How many {plants} does {N} plant?"
    return (a, b), q, "There are {a} rows of {b} {plants}.", f"{a}*{b}", a * b, "{N} plants {ans} {plants}."


def _cookies(rng, f):
    c, each, b = rng.randint(2, 6), rng.randint(1, 8), rng.randint(1, 10)
    a = c * each + b
    f.update(a=a, b=b, c=c)
    q = ("{N} bakes {a} cookies and eats {b} of them. {He} shares the rest equally among {c} friends. "
         "How many cookies does each friend get?")
    return (a, b, c), q, "{a} minus {b} cookies are left, shared by {c} friends.", f"({a}-{b})//{c}", each, \
        "Each friend gets {ans} cookies."


def _eggs(rng, f):
    a, b, c = rng.randint(2, 8), rng.randint(6, 12), rng.randint(1, 9)
    f.update(a=a, b=b, c=c)
    q = ("{N} buys {a} boxes of eggs with {b} eggs in each box. On the way home {c} eggs break. "
         "How many eggs are not broken?")
    return (a, b, c), q, "There were {a} times {b} eggs, and {c} broke.", f"{a}*{b}-{c}", a * b - c, \
        "{ans} eggs are not broken."


def _give(rng, f):
    a = rng.randint(5, 99)
    b = rng.randint(1, a)
    f.update(a=a, b=b, things=rng.choice(_COLLECTIONS))
    q = "{N} had {a} {things}. {He} gave {b} of them to {M}. How many {things} does {N} have left?"
    return (a, b), q, "{N} gave away {b} of {his} {a} {things}.", f"{a}-{b}", a - b, "{N} has {ans} {things} left."


def _together(rng, f):
    a, b = rng.randint(2, 60), rng.randint(2, 39)
    f.update(a=a, b=b, things=rng.choice(_COLLECTIONS))
    q = "{N} has {a} {things} and {M} has {b} {things}. How many {things} do they have [together|in total]?"
    return (a, b), q, "We add {N}'s {a} {things} and {M}'s {b}.", f"{a}+{b}", a + b, "They have {ans} {things}."


def _more_than(rng, f):
    a = rng.randint(10, 99)
    b = rng.randint(1, a - 1)
    f.update(a=a, b=b, things=rng.choice(_COLLECTIONS))
    q = "{N} has {a} {things} and {M} has {b}. How many more {things} does {N} have than {M}?"
    return (a, b), q, "The difference is {a} minus {b}.", f"{a}-{b}", a - b, "{N} has {ans} more {things}."


def _savings(rng, f):
    c, w = rng.randint(0, 30), rng.randint(2, 8)
    a = rng.randint(2, min(15, (99 - c) // w))
    f.update(a=a, c=c, w=w)
    q = ("{N} has {c} dollars saved and saves {a} more dollars every week. "
         "How many dollars will {N} have after {w} weeks?")
    return (c, a, w), q, "{N} adds {a} dollars each week for {w} weeks to the {c} dollars saved.", f"{c}+{a}*{w}", \
        c + a * w, "{N} will have {ans} dollars."


def _legs(rng, f):
    a, b = rng.randint(1, 12), rng.randint(1, 12)
    f.update(a=a, b=b)
    q = ("{N} has {a} [dogs|cats|rabbits] and {M} has {b} [dogs|cats|rabbits]. "
         "How many legs do their pets have in total?")
    return (a, b), q, "There are {a} plus {b} pets and each has 4 legs.", f"({a}+{b})*4", (a + b) * 4, \
        "Their pets have {ans} legs."


def _practice(rng, f):
    d = rng.randint(2, 7)
    a = rng.randint(5, 99 // d)
    f.update(a=a, d=d)
    q = ("{N} practises the [piano|violin|guitar|drums] for {a} minutes every day. "
         "How many minutes does {he} practise in {d} days?")
    return (a, d), q, "{a} minutes on each of {d} days.", f"{a}*{d}", a * d, "{N} practises for {ans} minutes."


TEMPLATES = (_buy, _change, _share, _older, _younger_later, _pages, _pages_left, _coins, _train, _bus, _garden,
             _cookies, _eggs, _give, _together, _more_than, _savings, _legs, _practice)


def _held_out_problem(rng: random.Random) -> tuple[str, dict]:
    """(split key, conversation): the template and its numbers decide the split, not the wording."""
    t, numbers, conv = _problem(rng)
    return f"{t}:{','.join(map(str, numbers))}", conv


def _problem(rng: random.Random) -> tuple[int, tuple[int, ...], dict]:
    t = rng.randrange(len(TEMPLATES))
    (name, he, his), (other, _, _) = rng.sample(_NAMES, 2)
    f = {"N": name, "he": he, "He": he.capitalize(), "his": his, "M": other}
    numbers, question, reason, expr, answer, result = TEMPLATES[t](rng, f)
    f["ans"] = answer
    q = expand(question, rng).format(**f)
    parts = [
        {"type": "text", "text": expand(reason, rng).format(**f) + " "},
        {"type": "python", "text": expr},
        {"type": "python_output", "text": str(answer)},
        {"type": "text", "text": "\n" + result.format(**f) + f"\n#### {answer}"},
    ]
    conv = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": parts}],
            "answer": str(answer), "template": TEMPLATES[t].__name__.lstrip("_")}
    return t, numbers, conv


class Arithmetic(GeneratedTask):
    """Word problems with one or two operations; the reply calls the calculator and ends `#### n`."""

    name = "arithmetic"
    eval_type = "generative"

    def get_example(self, index: int) -> dict:
        return self.draw_held_out(index, _held_out_problem)

    def evaluate(self, conversation: dict, response: str) -> bool:
        return numbers_equal(extract_answer(response), conversation["answer"])
