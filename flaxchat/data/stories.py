"""Built-in corpus: procedurally generated children's stories, so that every run works offline.

Every story is a small arc (a lost toy, learning to ride a bike, a scary storm, a new friend, ...)
told with a hero, a friend, a parent, a place and an object drawn at random, ending with a moral.
Each sentence comes from a template with inline alternatives, so the corpus has tens of thousands
of distinct sentence forms while staying simple enough for a tiny model to learn readable English,
in the spirit of TinyStories (Eldan & Li, 2023) but written here and generated on the fly.

Template markup (expanded by `_expand`, then `str.format_map` fills the story's slots):
  [a|b|c]   one of the alternatives, chosen per use (may nest, may be empty: "[very |]")
  <name>    one word or phrase from the list `_LISTS[name]`, chosen per use
  {slot}    a value fixed for the whole story (hero name, pronouns, the place, the object, ...)

Story i of seed s is a pure function of (s, split, i): the RNG is seeded with a BLAKE2 hash, not
Python's salted `hash()`, so every process and every Python run sees the same text. Paragraphs are
separated by a single newline, never a blank line, so a story dumped into a .txt file stays one
document for `flaxchat.data.sources` (which splits .txt files on blank lines).
"""

from __future__ import annotations

import functools
import hashlib
import random
from typing import Iterator

# --- vocabulary --------------------------------------------------------------------------------

_GIRLS = ("Lily", "Mia", "Sue", "Anna", "Lucy", "Emma", "Zoe", "Sara", "Ella", "Ruby", "Amy", "Nora",
          "Rosa", "Maya", "Ivy", "Kate", "Jane", "Daisy", "Molly", "Hana", "Lena", "Clara", "Grace",
          "Poppy", "Ada", "Nina", "Tess", "Bella", "Iris", "June", "Alma", "Priya", "Leila", "Mei",
          "Olivia", "Sophie", "Chloe", "Hazel", "Violet", "Stella", "Luna", "Aria", "Naomi", "Elsa",
          "Fatima", "Aisha", "Yara", "Sofia", "Lucia", "Frida", "Greta", "Heidi", "Ingrid", "Kira",
          "Lola", "Mabel", "Nell", "Opal", "Pearl", "Quinn", "Rita", "Sadie", "Thea", "Uma", "Vera",
          "Wendy", "Xenia", "Yuki", "Zara", "Bea", "Cora", "Dina", "Edie", "Fay", "Gina", "Holly")
_BOYS = ("Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Omar", "Jamal", "Kai", "Eli",
         "Noah", "Theo", "Hugo", "Ravi", "Milo", "Oscar", "Jake", "Luca", "Ned", "Pete", "Arlo",
         "Ollie", "Ivan", "Toby", "Remy", "Abe", "Dan", "Kenji", "Mateo", "Sami", "Yusuf", "Felix",
         "Oliver", "Henry", "Jasper", "Louis", "Arthur", "Caleb", "Dylan", "Ethan", "Gabe", "Isaac",
         "Jonah", "Kofi", "Liam", "Marco", "Nico", "Otto", "Pablo", "Rafael", "Simon", "Tariq",
         "Umar", "Victor", "Walter", "Xavier", "Yosef", "Zane", "Bruno", "Cyrus", "Diego", "Emil",
         "Frank", "Gus", "Hamza", "Idris", "Joel", "Karl", "Lars", "Moses", "Neil", "Owen", "Rory")
_PET_NAMES = ("Pip", "Bun", "Spot", "Coco", "Fluffy", "Whiskers", "Patch", "Bubbles", "Hoppy", "Nutmeg",
              "Pebble", "Sunny", "Biscuit", "Twig", "Momo", "Ziggy", "Dot", "Button", "Maple",
              "Puddle", "Clover", "Acorn", "Pepper", "Fern", "Waffles", "Bean", "Sprout", "Honey",
              "Pickles", "Noodle", "Dumpling", "Marbles", "Socks", "Tumble", "Wiggles", "Peanut",
              "Cinnamon", "Thimble", "Juniper", "Bramble", "Paws", "Mittens", "Scout", "Shadow",
              "Pumpkin", "Toffee", "Mochi", "Gizmo", "Tinker", "Snowball", "Custard", "Radish")
# (kind, how it moves, where it lives)
_ANIMALS = (
    ("bunny", "hopped", "in a cozy burrow under an old oak tree"),
    ("puppy", "ran", "in a little house with a red door"),
    ("kitten", "tiptoed", "in a warm house near the village"),
    ("duck", "waddled", "in a nest by a quiet pond"),
    ("fox", "trotted", "in a snug den at the edge of the forest"),
    ("bear cub", "lumbered", "in a big cave on the side of a hill"),
    ("mouse", "scurried", "in a tiny hole behind the kitchen wall"),
    ("squirrel", "scampered", "in a round nest high in a tall tree"),
    ("owl", "flew", "in a hollow tree deep in the woods"),
    ("frog", "hopped", "on a green lily pad in the pond"),
    ("turtle", "crawled", "in a sandy spot near the river"),
    ("piglet", "trotted", "on a busy farm with a red barn"),
    ("lamb", "skipped", "in a green field on a sunny farm"),
    ("hedgehog", "shuffled", "in a pile of leaves at the bottom of a garden"),
    ("penguin", "waddled", "on a big sheet of ice by the sea"),
    ("monkey", "swung", "in the tall trees of a warm jungle"),
    ("pony", "trotted", "in a stable on a hill"),
    ("goat", "climbed", "on a rocky hill above a village"),
    ("elephant", "stomped", "near a wide river in a sunny land"),
    ("raccoon", "crept", "in a hollow log in the woods"),
)
_HUMAN_HOMES = ("in a small house by the river", "in a cozy home at the edge of the forest",
                "on a busy farm", "in a little village near the hills", "in a tall building in the city",
                "in a yellow house on a quiet street", "in a blue house near the sea",
                "in a cottage with a big garden", "in a town full of trees", "in the town of {town}",
                "in a little house in {town}", "on a quiet lane in the village of {town}",
                "above the bakery in {town}")
_TRAITS = ("kind", "curious", "brave", "shy", "cheerful", "silly", "clever", "gentle", "playful",
           "careful", "busy", "friendly", "quiet", "proud", "stubborn", "funny", "helpful", "sleepy")
_SIZES = ("little", "small", "young", "tiny", "sweet", "happy", "curious", "friendly", "cheerful")
_HOBBIES = ("play outside", "sing songs", "look at the clouds", "collect shiny stones", "run in the grass",
            "draw pictures", "read books with {his} {par}", "dance in the rain", "splash in puddles",
            "watch the birds", "build towers with blocks", "help in the garden", "tell funny jokes",
            "play hide and seek", "pick flowers", "count the stars at night", "make mud pies")
# (speaking name, reference, pronoun)
_PARENTS = (("Mom", "mom", "she"), ("Dad", "dad", "he"), ("Grandma", "grandma", "she"),
            ("Grandpa", "grandpa", "he"), ("Mama", "mama", "she"), ("Papa", "papa", "he"))
_OBJECTS = (("ball", ("red", "blue", "bouncy", "big", "striped")), ("kite", ("red", "colorful", "green")),
            ("teddy bear", ("soft", "old", "brown", "fluffy")), ("hat", ("yellow", "funny", "woolly")),
            ("toy car", ("little", "shiny", "fast", "blue")), ("doll", ("pretty", "little", "rag")),
            ("picture book", ("big", "favorite", "old")), ("shell", ("pretty", "pink", "shiny")),
            ("key", ("shiny", "golden", "small")), ("balloon", ("red", "green", "big")),
            ("blanket", ("soft", "warm", "blue")), ("toy boat", ("little", "wooden", "red")),
            ("drum", ("small", "loud", "red")), ("scarf", ("long", "warm", "purple")),
            ("bell", ("little", "silver", "shiny")), ("crayon box", ("new", "big")),
            ("marble", ("blue", "glass", "shiny")), ("stuffed dog", ("soft", "floppy", "spotted")),
            ("necklace", ("pretty", "shiny", "bead")), ("whistle", ("shiny", "little", "silver")))
# (name, "at"/"in" form, hiding spots, sights)
_PLACES = (
    ("the park", "at the park", ("under the slide", "behind the big bench", "near the pond", "by the swings"),
     ("The swings moved gently in the wind.", "Ducks swam in the little pond.", "Children laughed on the slide.")),
    ("the forest", "in the forest", ("under a pile of leaves", "behind a mossy log", "near a tall pine tree",
                                     "by the little stream"),
     ("Tall trees reached up to the sky.", "Birds sang in the branches.", "The air smelled of pine.")),
    ("the garden", "in the garden", ("under the big pumpkin leaves", "behind the flower pots",
                                     "in the tall grass", "next to the watering can"),
     ("Red and yellow flowers grew everywhere.", "Bees buzzed around the roses.", "Tomatoes hung on the vines.")),
    ("the beach", "at the beach", ("under a beach towel", "behind a big rock", "in the soft sand",
                                   "near the tide pools"),
     ("The waves rolled in and out.", "Seagulls flew over the water.", "The sand was warm and golden.")),
    ("the meadow", "in the meadow", ("in the tall grass", "behind a big rock", "under a bush", "near the old fence"),
     ("Butterflies danced over the flowers.", "The grass waved in the breeze.", "A rabbit hopped by.")),
    ("the farm", "on the farm", ("in the hay", "behind the red barn", "near the chicken coop", "under the tractor"),
     ("The cows mooed in the field.", "Chickens pecked at the ground.", "The barn smelled of fresh hay.")),
    ("the playground", "at the playground", ("under the slide", "in the sandbox", "behind the climbing frame",
                                             "near the seesaw"),
     ("Kids climbed and swung and ran.", "The sandbox was full of buckets.", "The merry-go-round spun round.")),
    ("the river", "by the river", ("behind a big stone", "under a willow tree", "in the reeds", "near the bridge"),
     ("The water sparkled in the sun.", "Fish jumped in the river.", "A little boat floated by.")),
    ("the hill", "on the hill", ("behind a bush", "under an old tree", "in the tall grass", "near a big rock"),
     ("From the top you could see the whole town.", "The wind blew softly.", "Sheep grazed on the slope.")),
    ("the market", "at the market", ("under a fruit stand", "behind a basket of apples", "near the flower cart",
                                     "by the bread stall"),
     ("People sold apples, bread and cheese.", "It was busy and loud.", "The bread smelled warm and sweet.")),
    ("the backyard", "in the backyard", ("under the porch", "behind the shed", "in the sandbox",
                                         "next to the swing"),
     ("The grass was green and soft.", "A bird sat on the fence.", "The swing creaked in the wind.")),
    ("the library", "at the library", ("under a table", "behind a tall shelf", "near the reading rug",
                                       "by the big window"),
     ("There were books everywhere.", "It was quiet and calm.", "Sunlight came through the windows.")),
)
_TIMES = ("One sunny morning", "One rainy afternoon", "On a cold winter day", "One warm summer evening",
          "Early one spring morning", "One windy autumn day", "One bright day", "One snowy morning",
          "On a lazy Sunday", "One cloudy afternoon")
# (thing, trigger, facing it, what it turned out to be)
_FEARS = (
    ("the dark", "One night, the lights went out and the room became very dark.",
     "{N} opened {his} eyes wide and looked around.",
     "The soft moon was shining through the window, and the room did not look scary at all."),
    ("thunder", "One evening, a big storm came, and the thunder went boom!",
     "{N} sat by the window and listened to the rain.",
     "The thunder was loud, but it could not hurt {him}. It was only the sky making noise."),
    ("deep water", "One hot day, the family went to the lake to swim.",
     "{N} put one foot in the water, then the other.",
     "The water was cool and nice, and soon {N} was splashing and laughing."),
    ("the tall slide", "At the playground, all the kids were going down the tall slide.",
     "{N} climbed up the steps, one by one.", "Whoosh! {He} slid all the way down, and it was so much fun."),
    ("the big dog next door", "One day, the big dog next door came up to the fence.",
     "{N} slowly held out {his} hand.", "The dog licked {his} hand and wagged its tail. It was friendly!"),
    ("bees", "One afternoon, a bee flew right past {N}'s nose.",
     "{N} stood very still and watched the bee.",
     "The bee only wanted the flowers. It buzzed away and did not sting anyone."),
    ("the loud train", "One day, the family had to take the train to see {his} aunt.",
     "{N} held {his} {par}'s hand and stepped onto the train.",
     "The train rumbled and rocked, and {N} saw fields and cows rush past the window."),
    ("the big waves", "At the beach, the waves were big and noisy.",
     "{N} walked to the edge of the water.", "A small wave tickled {his} toes, and {he} laughed."),
)
# (base, -ing form, failure, success)
_SKILLS = (
    ("ride a bike", "riding a bike", "{He} wobbled and fell on the grass.", "{He} rode all the way down the street!"),
    ("swim", "swimming", "{He} splashed and swallowed some water.", "{He} swam from one side of the pool to the other!"),
    ("fly a kite", "flying a kite", "The kite crashed into the ground.", "The kite flew high up into the sky!"),
    ("bake a cake", "baking", "The cake came out flat and burnt.", "The cake came out soft and sweet!"),
    ("whistle", "whistling", "Only air came out.", "A clear, happy whistle came out!"),
    ("tie {his} shoes", "tying shoes", "The laces got all tangled.", "{He} tied a perfect bow!"),
    ("climb the big tree", "climbing", "{He} slipped and slid back down.", "{He} reached the highest branch!"),
    ("build a sandcastle", "building sandcastles", "A wave washed it away.", "{He} built a tall castle with four towers!"),
    ("jump rope", "jumping rope", "The rope caught {his} feet.", "{He} jumped twenty times without stopping!"),
    ("read a whole book", "reading", "The words were long and hard.", "{He} read every page by {himself}!"),
    ("skate", "skating", "{His} feet slid out and {he} sat down with a bump.", "{He} glided across the ice like a bird!"),
    ("play the drum", "drumming", "It sounded like a pot falling down the stairs.", "{He} played a happy song!"),
)
# (who, short name, how the hero helps, what happened after)
_CREATURES = (
    ("a little bird with a hurt wing", "bird", "wrapped its wing in a soft cloth and gave it some water",
     "A few days later, the bird flapped its wings and flew up into the sky."),
    ("a kitten stuck in a tree", "kitten", "climbed up carefully and carried it down",
     "The kitten purred and rubbed against {his} legs."),
    ("a lost puppy", "puppy", "read the name on its collar and walked it back home",
     "The puppy's owner was so happy that she gave {N} a big hug."),
    ("a baby duck that could not find its mother", "duckling", "walked it to the pond to look for its mother",
     "Soon they heard a loud quack, and the mother duck came swimming to them."),
    ("a tiny snail on the hot path", "snail", "lifted it gently onto a cool green leaf",
     "The snail poked out its eyes and slowly crawled away."),
    ("a butterfly caught in a spider web", "butterfly", "carefully pulled the sticky threads away",
     "The butterfly fluttered its bright wings and flew to a flower."),
    ("a turtle lying on its back", "turtle", "turned it over very gently",
     "The turtle blinked at {him} and walked slowly to the water."),
    ("a hungry little squirrel", "squirrel", "shared {his} nuts and left some by the tree",
     "The squirrel ate every nut and chattered happily."),
)
# (what not to do, what happened)
_RULES = (
    ("play ball in the house", "The ball hit a vase, and it broke into pieces."),
    ("go near the pond alone", "{N} slipped on the mud and fell into the cold water."),
    ("eat the cookies before dinner", "{He} got a tummy ache and could not eat any dinner."),
    ("climb on the kitchen shelf", "The shelf shook, and a jar of jam fell down with a crash."),
    ("go outside without {his} coat", "{He} got very cold and started to sneeze."),
    ("jump on the bed", "{He} bounced too high and bumped {his} head on the wall."),
    ("open the gate", "The chickens ran out and scattered all over the yard."),
    ("paint on the walls", "The paint would not come off, and the wall was a big mess."),
)
# (what is found, short name, where it leads)
_MYSTERIES = (
    ("an old map with a red X on it", "map", "Under the red X, they found a box full of old toys and a note that said, \"Share these with your friends.\""),
    ("a tiny door at the bottom of a tree", "door", "Behind the door was a little room where a family of mice was having tea."),
    ("a big speckled egg in the grass", "egg", "The egg cracked open, and out came a fluffy baby goose."),
    ("a glowing stone by the path", "stone", "When the sun went down, the stone lit up the whole path like a lamp."),
    ("a bottle with a message inside", "bottle", "The message was from a girl across the sea who wanted a pen friend."),
    ("a set of muddy footprints", "footprints", "The footprints led to a mother deer and her baby, sleeping in the grass."),
    ("a secret path behind the bushes", "path", "At the end of the path was a hidden garden full of strawberries."),
)
# Broader vocabulary for the descriptive beats. Beyond variety, it sets how many BPE merges the
# corpus supports: with the arc words alone, merges run out near a 2,300-token vocabulary, short
# of the 4,096 a small model wants.
_TOWN_PARTS = ("Willow Maple Oak Ash Pine Elm Birch Cedar Hazel Clover Fern Moss Stone River Brook Hill "
               "Sun Moon Star Rain Snow Frost Honey Apple Berry Plum Pepper Thistle Bramble Amber Silver "
               "Golden Copper Rose Holly Briar Meadow Marsh Fox Deer Wren Robin Lark Swan Otter Badger "
               "Button Puddle Cricket Daisy").split(), (
               "brook wood field dale ford ton bury vale hollow stead well ridge mere combe haven port "
               "gate moor wick shire").split()
_SURNAME_ENDS = "bottom worth by kins ley son stone more berry smith wright man ham ing ridge".split()
_JOBS = ("baker", "farmer", "doctor", "teacher", "fisherman", "painter", "mail carrier", "firefighter",
         "librarian", "gardener", "carpenter", "shopkeeper", "beekeeper", "tailor", "potter", "nurse")
_LISTS = {
    "color": tuple("red blue green yellow purple pink orange brown white gray golden silver violet "
                   "scarlet crimson lavender turquoise amber".split()),
    "flowers": tuple("daisies tulips roses sunflowers poppies daffodils dandelions bluebells buttercups "
                     "marigolds lilacs snowdrops orchids pansies primroses violets".split()),
    "animals": tuple("robins sparrows crows pigeons swans geese herons woodpeckers parrots eagles seagulls "
                     "ladybugs beetles ants caterpillars dragonflies fireflies grasshoppers crickets moths "
                     "worms snails deer badgers otters beavers moles bats lizards crabs dolphins seals cows "
                     "sheep horses chickens donkeys goats butterflies bees ducks frogs rabbits squirrels "
                     "hedgehogs mice owls foxes turkeys peacocks kittens puppies".split()),
    "number": tuple("two three four five six seven eight nine ten eleven twelve".split()),
    "foods": tuple("apples pears plums cherries bananas grapes peaches carrots peas potatoes tomatoes "
                   "strawberries blueberries raspberries oranges nuts cookies muffins pancakes waffles "
                   "noodles sandwiches cupcakes biscuits crackers pretzels dumplings olives".split()),
    "drink": ("warm milk", "cold lemonade", "hot cocoa", "apple juice", "mint tea", "fresh water",
              "orange juice", "a cup of soup"),
    "clothes": tuple("boots raincoat mittens sweater jacket scarf hat socks sneakers sandals overalls "
                     "dress pajamas gloves cap vest".split()),
    "instrument": tuple("piano violin flute guitar trumpet harp banjo xylophone tambourine ukulele "
                        "harmonica cello accordion".split()),
    "vehicle": ("bus", "tractor", "train", "truck", "bicycle", "fire engine", "ice cream van",
                "delivery van", "horse and cart", "motorbike", "taxi", "school bus"),
    "weather": ("The sun was shining brightly.", "Fluffy white clouds floated across the sky.",
                "A soft rain was falling.", "The wind whistled through the trees.",
                "Snowflakes drifted down from the gray sky.", "A rainbow stretched across the sky.",
                "The air was warm and still.", "Thick fog covered the ground.",
                "Frost sparkled on the grass.", "Thunder rumbled far away.", "Puddles shone after the rain."),
    "activity": ("built a fort out of pillows", "painted a picture of the sea", "made paper boats",
                 "played tag in the yard", "read a story about pirates", "planted sunflower seeds",
                 "fed the ducks", "jumped in a pile of leaves", "made a chain of <flowers>",
                 "played catch", "baked <foods> with {his} {par}", "blown soap bubbles",
                 "drawn castles with chalk", "sung silly songs", "learned a song on the <instrument>",
                 "watched the <animals> in the field", "ridden on the <vehicle>", "hunted for <color> pebbles"),
    "happy": ("happy", "glad", "very happy", "so happy", "full of joy", "excited", "proud"),
    "sad": ("sad", "upset", "very sad", "unhappy", "gloomy"),
    "scared": ("scared", "afraid", "nervous", "worried", "a little scared"),
    "said": ("said", "said", "said softly", "said with a smile"),
    "replied": ("said", "replied", "answered"),
    "cried": ("cried", "shouted", "said", "called out"),
    "smiled": ("smiled", "grinned", "beamed", "laughed"),
    "together": ("together", "side by side", "all together"),
    "good": ("good", "nice", "lovely", "wonderful", "great"),
    "end": ("The end.", "And they all lived happily ever after.", "It was the best day ever.",
            "That night, {N} went to sleep with a big smile.", "And that is the story of {N} and {F}.", ""),
}

# --- template engine ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _compile(text: str) -> tuple:
    """Parse markup into a tuple of parts: literal strings and tuples of alternatives (each compiled)."""
    parts, pos = _parse(text, 0, top=True)
    return parts


def _parse(text: str, pos: int, top: bool) -> tuple[tuple, int]:
    parts, buf = [], []
    while pos < len(text):
        c = text[pos]
        if c == "[":
            alts, pos = _parse_alts(text, pos + 1)
        elif c == "<":
            end = text.index(">", pos)
            alts, pos = tuple(_compile(w) for w in _LISTS[text[pos + 1:end]]), end + 1
        elif not top and c in "|]":
            break
        else:
            buf.append(c)
            pos += 1
            continue
        if buf:
            parts.append("".join(buf))
            buf = []
        parts.append(alts)
    if buf:
        parts.append("".join(buf))
    return tuple(parts), pos


def _parse_alts(text: str, pos: int) -> tuple[tuple, int]:
    alts = []
    while True:
        part, pos = _parse(text, pos, top=False)
        alts.append(part)
        if text[pos] == "]":
            return tuple(alts), pos + 1
        pos += 1  # skip '|'


def _expand(parts: tuple, rng: random.Random, out: list) -> None:
    for p in parts:
        if type(p) is str:
            out.append(p)
        else:
            _expand(rng.choice(p), rng, out)


def _sentence(template: str, rng: random.Random, slots: dict) -> str:
    out: list[str] = []
    _expand(_compile(template), rng, out)
    s = "".join(out).format_map(slots)
    if s[:1] == '"':
        return '"' + s[1:2].upper() + s[2:]
    return s[:1].upper() + s[1:]


# --- story arcs ---------------------------------------------------------------------------------
# An arc is a tuple of paragraphs; a paragraph is a tuple of beats; a beat is one template or a tuple
# of alternative templates. A beat that starts with "?" is optional (kept half the time).

_OPENING = ((
    ("Once upon a time, there was {N_intro} who lived {home}.",
     "There once was {N_intro}. {He} lived {home}.",
     "Long ago, {N_intro} lived {home}.",
     "{N} was {N_a_size} {kind} who lived {home}.",
     "In a place not far from here, there lived {N_intro}."),
    ("{He} was very {trait} and loved to {hobby}.",
     "{N} was {trait_a} {kind}, and {his} favorite thing was to {hobby}.",
     "Every day, {N} liked to {hobby}.",
     "More than anything, {N} loved to {hobby}."),
    "@",
    ("?{N}'s best friend was {F_intro}.",
     "?{N} had a friend named {F}, who was {F_a_kind}.",
     "?{F} was {N}'s [best|closest|dearest] friend."),
),)

_ARCS = {
    "lost": (
        (("{N} had {O_a}. {He} [loved|liked] {his} {O} more than anything.",
          "{His} {par} had given {him} {O_a} for {his} birthday, and {he} took it everywhere."),
         ("{Time}, {N} took the {O} to {P}.", "{Time}, {N} [went|walked] to {P} with {his} {O}."),
         "?{P_sight}",
         "{He} played {at_P} [all morning|for a long time|until the sun was high|with {F}].",
         ("When it was time to go home, {N} [looked for|reached for] {his} {O}, but it was gone!",
          "[Suddenly|Then], {N} saw that {his} {O} was [gone|missing]!")),
        ('"[Where is my {O}?|Oh no, my {O}!|Has anyone seen my {O}?]" <cried> {N}.',
         "{N} [felt|was] <sad>.",
         ("{He} looked {spot1}, but it was not there.", "First {he} looked {spot1}. No {O}."),
         ("Then {he} looked {spot2}. [Still nothing.|It was not there either.]",
          "{He} searched {spot2}, but {he} could not find it."),
         '?{F} [came by|walked up|saw {him}] and asked, "Why are you <sad>, {N}?"',
         '"I lost my {O}," {N} <replied> [quietly|sadly|with a sigh].',
         '"[Don\'t worry|Do not be sad], I will help you [look|find it]!" <said> {F}.'),
        (("At last, {F} [saw|spotted] something {spot3}. It was the {O}!",
          "[Together|Side by side], they looked {spot3}, and there it was!"),
         "{N} was <happy>. {He} hugged {F} and said, \"Thank you!\"",
         ("{N} learned that [friends help each other|a good friend makes every problem smaller].",
          "From that day on, {N} [was always careful with|kept a close eye on] {his} {O}."),
         "?<end>"),
    ),
    "share": (
        (("{N} had {O_a}, and {he} [played with it every day|never let it out of {his} sight].",
          "{Time}, {N} got {O_a} as a present."),
         "{He} took it to {P} to play.",
         "?{P_sight}",
         "{F} saw the {O} and [said|asked], \"Can I play with it too?\""),
        ('"No! It is mine!" <said> {N}, and {he} held the {O} [tight|close].',
         "{F} [walked away|looked down] and felt <sad>.",
         "{N} played alone, but it was not [fun|much fun] [anymore|at all].",
         ("{He} thought about {F}'s sad face.", "{He} felt a funny, heavy feeling in {his} tummy."),
         "?{His} {par} said, \"[Toys|Games] are more fun when we share them.\""),
        ("{N} ran to {F} and said, \"[I am sorry|Sorry I was mean]. Do you want to play with my {O}?\"",
         "{F} <smiled>, and they played {at_P} [together|all afternoon|until dinner time].",
         ("{N} learned that sharing makes [playing|everything] more fun.",
          "That day, {N} learned that a toy shared is twice the fun."),
         "?<end>"),
    ),
    "fear": (
        (("{N} was afraid of {fear}.", "There was one thing {N} did not like: {fear}."),
         "?Just thinking about {fear} made {him} feel <scared>.",
         "{fear_trigger}",
         "{N} [hid under {his} blanket|held {his} {O} tight|ran to {his} {par}] and felt <scared>."),
        ('{His} {par} [knelt down|sat next to {him}] and said, "It is okay to be scared. [Being brave means trying anyway.|I am right here with you.]"',
         '?"[Do you want to try together?|Shall we be brave together?]" asked {his} {par}.',
         "{N} took a [deep|big] breath.",
         "{fear_face}"),
        ("{fear_after}",
         "{N} was <happy>. {He} was not afraid of {fear} anymore.",
         ("{N} learned that [things are often less scary when you face them|being brave feels good].",
          "From then on, whenever {N} felt scared, {he} remembered that day."),
         "?<end>"),
    ),
    "learn": (
        (("{N} wanted to learn to {skill}.", "{N} really wanted to {skill}, just like the big kids."),
         "?{He} watched the others {at_P} and wished {he} could do it too.",
         "{Time}, {he} tried for the first time.",
         "{skill_fail}"),
        ("{N} felt <sad>. \"[I can't do it|This is too hard]!\" {he} <cried>.",
         ('{His} {par} <smiled> and said, "[Nobody|No one] is good at {skilling} at first. Keep trying!"',
          '{F} said, "I fell down a lot when I started too. Try again!"'),
         "So {N} tried again. And again.",
         "{He} practiced every day, [even when it was hard|even when {he} was tired|rain or shine]."),
        (("One day, it finally worked. {skill_win}", "Then, one <good> morning, {skill_win}"),
         "{N} [jumped up and down|shouted with joy|laughed out loud]. {He} felt so <happy>!",
         ("{N} learned that if you keep trying, you can do hard things.",
          "{N} learned that practice [makes things easier|is the secret to learning]."),
         "?<end>"),
    ),
    "help": (
        ("{Time}, {N} was walking {at_P} with {F}.",
         "?{P_sight}",
         "[Suddenly|Then], {he} saw {cr}.",
         '"Oh, the poor {cr_s}!" <cried> {N}.'),
        ("?{F} said, \"What should we do?\"",
         "{N} [thought for a moment|knew just what to do].",
         "[So|Then|Without waiting], {he} {cr_help}.",
         "?{F} helped too, and {his} {par} came to see."),
        ("{cr_after}",
         "{N} and {F} felt warm and <happy> inside.",
         ("{N} learned that [being kind|helping others] is [the best feeling|always worth it].",
          "{N} learned that even small kindness can make a big difference."),
         "?<end>"),
    ),
    "rule": (
        ('{Time}, {N}\'s {par} said, "[Please do not|Do not|You must not] {rule_you}."',
         "{N} nodded, but {he} [was bored|did not really listen|thought it would be fine].",
         "?{He} looked around. Nobody was watching.",
         "So {N} decided to {rule} anyway."),
        ("[Oh no!|Uh oh!] {rule_bad}",
         "{N} felt <sad> and <scared>.",
         "{He} went to {his} {par} and said, \"[I am sorry, I did not listen.|I should have listened to you.|I am sorry. I did not listen to you.]\""),
        ("{His} {par} gave {him} a [big|warm] hug. \"Thank you for telling me the truth,\" {parhe} said.",
         "?They cleaned up <together>.",
         ("{N} learned that rules are there to keep us safe.",
          "From that day on, {N} always listened to {his} {par}."),
         "?<end>"),
    ),
    "discover": (
        ("{Time}, {N} and {F} were playing {at_P}.",
         "?{P_sight}",
         "Then {N} found {myst}.",
         '"[What is this?|Look at this!|How strange!]" <cried> {N}.'),
        ("{F} looked at the {myst_s} and said, \"[Let\'s find out!|Let\'s explore!]\"",
         "?They were a little <scared>, but they were curious too.",
         "They [walked|followed the clues] [together|side by side] {at_P}.",
         "?[They looked everywhere.|It took a long time.]"),
        ("{myst_find}",
         "{N} and {F} [laughed|clapped|gasped] with joy.",
         ("{N} learned that [the world is full of surprises|being curious can lead to wonderful things].",
          "It was an adventure that {N} and {F} would never forget."),
         "?<end>"),
    ),
    "newfriend": (
        ("{Time}, a new {F_kind} named {F} came to {P}.",
         "{F} sat all alone and [did not talk to anyone|looked at the ground].",
         "?{P_sight}",
         "{N} saw that {F} looked <sad>."),
        ("{N} walked over and said, \"[Hi|Hello], I am {N}. Do you want to play with me?\"",
         "{F} looked up and <smiled>. \"Yes, please!\" {fhe} said.",
         "They played with {N}'s {O} [all afternoon|until the sun went down|for hours]."),
        ("?At the end of the day, {F} said, \"Thank you for being my friend.\"",
         "From that day on, {N} and {F} were best friends.",
         ("{N} learned that a [smile|kind word] can make a new friend.",
          "{N} learned that it is good to be kind to someone new."),
         "?<end>"),
    ),
    "honest": (
        ("{N}'s {par} had a favorite {dish} with [blue flowers|little birds|golden stars] on it.",
         "{Time}, {N} was playing with {his} {O} near the table.",
         "[Crash!|Bang!] The {dish} fell [and broke|to the floor and broke into pieces]."),
        ("{N} was <scared>. {He} hid the pieces under the rug.",
         "When {his} {par} came home, {N} did not say anything.",
         "But {N} felt bad inside, and {he} could not [smile|eat {his} dinner|sleep]."),
        ('At last {N} said, "I broke it. I am sorry."',
         "{His} {par} hugged {him}. \"Thank you for telling the truth. That is more important than any {dish}.\"",
         ("{N} learned that telling the truth [makes you feel better|is always the right thing to do].",
          "{N} learned that it is better to be honest, even when it is hard."),
         "?<end>"),
    ),
    "gift": (
        ("{Time}, {N} remembered that it was {F}'s birthday.",
         "{He} wanted to give {F} a [special|<good>] present.",
         "?But {he} did not have any money."),
        ("So {N} [picked flowers {at_P}|drew a picture of the two of them|made a card with glitter].",
         "?[It took a long time|It was hard work], but {he} did not give up.",
         "[On the way to {F}'s house|Just then], the wind blew, and {his} present [flew away|fell in a puddle].",
         "{N} was <sad>, but then {he} had an idea.",
         "{He} gave {F} {his} {O} and a [big|warm] hug instead."),
        ("{F} was <happy>. \"This is the best present ever,\" {fhe} said.",
         ("{N} learned that the best gifts come from the heart.",
          "{N} learned that giving can feel even better than getting."),
         "?<end>"),
    ),
}
_ARC_NAMES = tuple(_ARCS)
# "@" beats in the arcs draw one of these (optional, like "?" beats).
_DETAILS = (
    "<weather>",
    "[Near the path|Nearby|Not far away], {he} saw <number> <animals>.",
    "{He} [wore|had on] {his} <color> <clothes>.",
    "[For lunch|For a snack|At noon], {N} ate some <foods> and drank <drink>.",
    "The air smelled of <flowers>.",
    "<color> and <color> <flowers> grew [along the path|by the fence|everywhere].",
    "[Somewhere|Far away|Down the street], someone was playing the <instrument>.",
    "A <vehicle> [went|rolled|rumbled] past.",
    "{nb}, the {nb_job}, waved [hello|from the window|and smiled].",
    "Everyone in {town} knew {N}.",
    "{N} [hummed a little song|skipped along|counted the clouds|looked at the <animals>].",
    "Earlier that day, {N} and {F} had <activity>.",
    "{He} had already <activity> [that morning|before breakfast|the day before].",
    "{N} {moves} along [happily|as fast as {he} could|without a care in the world].",
)
# Beats told after the resolution and before the moral, whatever the arc.
_EVENING = (
    "?That [evening|night], {N} told {his} {par} [all about the day|the whole story|what had happened].",
    '?{His} {par} [smiled|listened and smiled|gave {him} a hug] and said, "[I am so proud of you|What a day you had|You did well], {N}."',
)


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _character(rng: random.Random, avoid: str = "") -> dict:
    """A hero or friend: name, kind, pronouns, and (for animals) how it moves and where it lives."""
    female = rng.random() < 0.5
    if rng.random() < 0.45:
        kind, moves, home = rng.choice(_ANIMALS)
        names = _PET_NAMES
    else:
        kind, moves, home = ("girl" if female else "boy"), "walked", rng.choice(_HUMAN_HOMES)
        names = _GIRLS if female else _BOYS
    name = rng.choice(names)
    while name == avoid:
        name = rng.choice(names)
    return {"name": name, "kind": kind, "home": home, "moves": moves, "female": female}


def _slots(rng: random.Random) -> dict:
    hero = _character(rng)
    friend = _character(rng, avoid=hero["name"])
    he, him, his = ("she", "her", "her") if hero["female"] else ("he", "him", "his")
    fhe, fhim, fhis = ("she", "her", "her") if friend["female"] else ("he", "him", "his")
    _, par_ref, parhe = rng.choice(_PARENTS)
    obj, adjs = rng.choice(_OBJECTS)
    place, at_place, spots, sights = rng.choice(_PLACES)
    spot1, spot2, spot3 = rng.sample(spots, 3)
    size, trait = rng.choice(_SIZES), rng.choice(_TRAITS)
    fear, fear_trigger, fear_face, fear_after = rng.choice(_FEARS)
    skill, skilling, skill_fail, skill_win = rng.choice(_SKILLS)
    cr, cr_s, cr_help, cr_after = rng.choice(_CREATURES)
    rule, rule_bad = rng.choice(_RULES)
    myst, myst_s, myst_find = rng.choice(_MYSTERIES)
    town = rng.choice(_TOWN_PARTS[0]) + rng.choice(_TOWN_PARTS[1])
    neighbor = rng.choice(("Mr.", "Mrs.", "Old Mr.", "Old Mrs.", "Miss"))
    surname = rng.choice(_TOWN_PARTS[0]) + rng.choice(_SURNAME_ENDS)
    s = {
        "town": town, "nb": f"{neighbor} {surname}", "nb_job": rng.choice(_JOBS),
        "N": hero["name"], "kind": hero["kind"], "home": hero["home"], "moves": hero["moves"],
        "N_intro": f"{_a(size)} {hero['kind']} named {hero['name']}", "N_a_size": _a(size),
        "he": he, "He": he.capitalize(), "him": him, "his": his, "His": his.capitalize(),
        "himself": "herself" if hero["female"] else "himself", "trait": trait,
        "trait_a": _a(trait), "hobby": rng.choice(_HOBBIES),
        "F": friend["name"], "F_kind": friend["kind"], "F_a_kind": _a(friend["kind"]),
        "F_intro": f"{_a(friend['kind'])} named {friend['name']}", "fhe": fhe, "fhim": fhim, "fhis": fhis,
        "par": par_ref, "parhe": parhe,
        "O": obj, "O_a": _a(f"{rng.choice(adjs)} {obj}"),
        "P": place, "at_P": at_place, "spot1": spot1, "spot2": spot2, "spot3": spot3,
        "P_sight": rng.choice(sights), "Time": rng.choice(_TIMES),
        "fear": fear, "fear_trigger": fear_trigger, "fear_face": fear_face, "fear_after": fear_after,
        "skill": skill, "skilling": skilling, "skill_fail": skill_fail, "skill_win": skill_win,
        "cr": cr, "cr_s": cr_s, "cr_help": cr_help, "cr_after": cr_after,
        "rule": rule, "rule_you": rule.replace("{his}", "your"), "rule_bad": rule_bad,
        "dish": rng.choice(("cup", "plate", "vase", "bowl", "teapot")),
        "myst": myst, "myst_s": myst_s, "myst_find": myst_find,
    }
    # Some vocabulary carries pronoun slots ("tie {his} shoes"); resolve them once per story.
    for k, v in s.items():
        if "{" in v:
            s[k] = v.format_map(s)
    return s


def _render(paragraphs: tuple, rng: random.Random, slots: dict, keep_optional: float) -> list[str]:
    out = []
    for para in paragraphs:
        sentences = []
        for beat in para:
            template = beat if isinstance(beat, str) else rng.choice(beat)
            if template == "@":
                template = "?" + rng.choice(_DETAILS)
            if template[0] == "?":
                if rng.random() >= keep_optional:
                    continue
                template = template[1:]
            text = _sentence(template, rng, slots)
            if text:
                sentences.append(text)
        if sentences:
            out.append(" ".join(sentences))
    return out


class _Rng(random.Random):
    def choice(self, seq):
        # One C call instead of the stdlib's rejection loop: generation is ~30% faster. The bias
        # (at most len(seq)/2**53) is irrelevant here.
        return seq[int(self.random() * len(seq))]


def _rng(seed: int, split: str, index: int) -> random.Random:
    digest = hashlib.blake2b(f"flaxchat-stories/{seed}/{split}/{index}".encode(), digest_size=8).digest()
    return _Rng(int.from_bytes(digest, "little"))


def story(seed: int, i: int, split: str = "train") -> str:
    """Story number `i` of the corpus (seed, split): 100-300 words, the same text in every process."""
    text, words = _draw(seed, split, i, keep_optional=0.5)
    if not 100 <= words <= 300:
        # Optional beats make the length vary; redraw the same story with them biased the right way.
        text, _ = _draw(seed, split, i, keep_optional=1.0 if words < 100 else 0.0)
    return text


def _draw(seed: int, split: str, i: int, keep_optional: float) -> tuple[str, int]:
    rng = _rng(seed, split, i)
    slots = _slots(rng)
    arc = _arc_with_details(rng.choice(_ARC_NAMES))
    text = "\n".join(_render(_OPENING, rng, slots, keep_optional) + _render(arc, rng, slots, keep_optional))
    return text, text.count(" ") + text.count("\n") + 1


@functools.lru_cache(maxsize=None)
def _arc_with_details(name: str) -> tuple:
    """The arc with detail beats ("@") sprinkled in and the evening beats before the moral."""
    first, *middle, last = _ARCS[name]
    first = first[:2] + ("@",) + first[2:]
    middle = [para + ("@",) for para in middle]
    last = last[:-2] + _EVENING + last[-2:]
    return (first, *middle, last)


class StoriesCorpus:
    """The built-in corpus as a document source (see `flaxchat.data.sources.Source`).

    `split="train"` and `split="val"` draw from independent hash streams, so the two never share a
    generated document by construction (identical text could only arise by coincidence).
    """

    def __init__(self, seed: int = 0, num_docs: int = 1_000_000, split: str = "train"):
        self.seed, self.num_docs, self.split = seed, num_docs, split
        self.name = f"built-in procedural stories (seed {seed}, {split}, {num_docs:,} docs)"

    def __len__(self) -> int:
        return self.num_docs

    def doc(self, i: int) -> str:
        if not 0 <= i < self.num_docs:
            raise IndexError(f"story {i} is outside 0..{self.num_docs - 1}")
        return story(self.seed, i, self.split)

    def iter_docs(self, start: int = 0, step: int = 1) -> Iterator[tuple[int, str]]:
        for i in range(start, self.num_docs, step):
            yield i, story(self.seed, i, self.split)
