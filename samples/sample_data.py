"""The sample adapters' data, generated from templates (no downloads).

One question bank serves `pirate` and `json-reply`: families of templated questions
(capitals, arithmetic, colours, animal sounds, opposites, trivia, tips, definitions,
chit-chat...) whose answers are known, each as a short fact and a plain sentence. Per
family, some fillers (countries, animals, topics...) and one template are held out: a
held-out prompt uses a held-out filler or the held-out template, so it never appears in
training. `FREE_FORM_PROMPTS` are open questions of no family at all, only ever evaluated.

`french-words` is a closed vocabulary (behaviours.FRENCH_VOCAB): every word is trained
under some phrasings; the held-out prompts are the same words under phrasings never
trained (a closed vocabulary cannot hold out words it is meant to teach).

Everything is deterministic: `random.Random(seed)` only.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from .behaviours import DEMO_PROMPTS, FRENCH_VOCAB


@dataclass(frozen=True)
class Item:
    prompt: str
    short: str     # the bare fact: "Paris"
    sentence: str  # the fact as a sentence: "The capital of France is Paris."
    family: str


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


# --------------------------------------------------------------------- the families
# Each family: templates (the last one is held out), fillers, and a function from a
# filler to (short, sentence). Template fields are filled from the filler tuple.

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Russia", "Moscow"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Greece", "Athens"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("the United Kingdom", "London"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"),
    ("Turkey", "Ankara"), ("Australia", "Canberra"), ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"), ("Hungary", "Budapest"), ("the Czech Republic", "Prague"),
    ("Cuba", "Havana"), ("Indonesia", "Jakarta"), ("Iran", "Tehran"), ("Morocco", "Rabat"),
    ("Nigeria", "Abuja"), ("Switzerland", "Bern"), ("the Philippines", "Manila"), ("Ukraine", "Kyiv"),
]
COLOURS = [
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
    ("coal", "black"), ("a strawberry", "red"), ("a lemon", "yellow"), ("a ripe tomato", "red"),
    ("a carrot", "orange"), ("milk", "white"), ("a pumpkin", "orange"), ("a frog", "green"),
    ("chocolate", "brown"), ("a crow", "black"), ("a lime", "green"), ("an eggplant", "purple"),
    ("a flamingo", "pink"), ("an elephant", "gray"), ("a polar bear", "white"), ("a cherry", "red"),
    ("the sea", "blue"), ("a school bus", "yellow"), ("a fire truck", "red"), ("a tree trunk", "brown"),
]
SOUNDS = [
    ("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
    ("pig", "oink"), ("horse", "neigh"), ("lion", "roar"), ("owl", "hoot"), ("snake", "hiss"),
    ("bee", "buzz"), ("frog", "croak"), ("mouse", "squeak"), ("wolf", "howl"),
    ("rooster", "cock-a-doodle-doo"), ("donkey", "hee-haw"), ("turkey", "gobble"), ("crow", "caw"),
]
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("open", "closed"), ("day", "night"), ("wet", "dry"), ("full", "empty"),
    ("early", "late"), ("high", "low"), ("left", "right"), ("hard", "soft"), ("loud", "quiet"),
    ("rich", "poor"), ("strong", "weak"), ("win", "lose"), ("begin", "end"), ("young", "old"),
    ("north", "south"), ("east", "west"), ("inside", "outside"), ("push", "pull"), ("true", "false"),
    ("always", "never"), ("buy", "sell"), ("laugh", "cry"),
]
LEGS = [
    ("spider", 8), ("ant", 6), ("dog", 4), ("bird", 2), ("cat", 4), ("horse", 4), ("chicken", 2),
    ("cow", 4), ("beetle", 6), ("crab", 10), ("duck", 2), ("bee", 6), ("lion", 4), ("snake", 0),
    ("fish", 0), ("kangaroo", 2), ("frog", 4), ("butterfly", 6), ("penguin", 2), ("elephant", 4),
]
SIDES = [("triangle", 3), ("square", 4), ("pentagon", 5), ("hexagon", 6), ("octagon", 8),
         ("rectangle", 4), ("heptagon", 7), ("decagon", 10)]
UNITS = [
    ("days", "week", "7"), ("months", "year", "12"), ("hours", "day", "24"), ("minutes", "hour", "60"),
    ("seconds", "minute", "60"), ("days", "year", "365"), ("weeks", "year", "52"),
    ("centimeters", "meter", "100"), ("grams", "kilogram", "1000"), ("meters", "kilometer", "1000"),
    ("inches", "foot", "12"), ("cents", "dollar", "100"), ("years", "century", "100"),
    ("years", "decade", "10"), ("eggs", "dozen", "12"), ("minutes", "day", "1440"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
USES = [
    ("a hammer", "to hit nails into wood"), ("an umbrella", "to keep you dry in the rain"),
    ("a fridge", "to keep food cold"), ("a key", "to open a lock"), ("a spoon", "to eat soup"),
    ("a pen", "to write"), ("a ladder", "to reach high places"), ("a clock", "to tell the time"),
    ("a map", "to find your way"), ("soap", "to wash things clean"), ("a broom", "to sweep the floor"),
    ("a thermometer", "to measure temperature"), ("a telescope", "to look at faraway things like stars"),
    ("a pillow", "to rest your head when you sleep"), ("a kettle", "to boil water"),
    ("a camera", "to take photos"), ("a compass", "to find north"), ("a ruler", "to measure length"),
    ("a needle", "to sew cloth"), ("a shovel", "to dig holes"),
]
TIPS = [
    ("sleeping better", "Go to bed at the same time every night."),
    ("studying", "Study in short sessions and take a break every half hour."),
    ("staying healthy", "Eat plenty of vegetables, drink water and move every day."),
    ("saving money", "Write down what you spend and put a little aside each week."),
    ("learning a language", "Practice a few new words every day and say them out loud."),
    ("cooking pasta", "Use plenty of salted water and taste it before the time is up."),
    ("running", "Start slowly and add a little distance each week."),
    ("making friends", "Ask people questions and really listen to their answers."),
    ("writing an essay", "Make a short plan before you start writing."),
    ("gardening", "Water your plants early in the morning."),
    ("public speaking", "Practice your talk out loud a few times before the day."),
    ("keeping a room tidy", "Put things back where they belong right after you use them."),
    ("drinking more water", "Keep a bottle of water with you all day."),
    ("reading more", "Read ten pages every night before bed."),
    ("waking up early", "Put your alarm clock on the other side of the room."),
    ("taking good photos", "Keep the light behind you and hold the camera steady."),
    ("staying calm", "Take a few slow, deep breaths."),
    ("packing for a trip", "Make a list and roll your clothes instead of folding them."),
    ("focusing at work", "Turn off notifications and do one task at a time."),
    ("baking bread", "Let the dough rise in a warm place until it doubles in size."),
]
FUN_FACTS = [
    ("octopuses", "Octopuses have three hearts."),
    ("butterflies", "Butterflies taste with their feet."),
    ("hummingbirds", "Hummingbirds can fly backwards."),
    ("sea otters", "Sea otters hold hands while they sleep."),
    ("camels", "Camels store fat, not water, in their humps."),
    ("frogs", "Frogs drink water through their skin."),
    ("starfish", "Starfish have no brain."),
    ("zebras", "Every zebra has its own pattern of stripes."),
    ("bats", "Bats are the only mammals that can fly."),
    ("koalas", "Koalas sleep up to twenty hours a day."),
    ("giraffes", "A giraffe's neck has seven bones, like a human neck."),
    ("penguins", "Penguins cannot fly, but they are great swimmers."),
    ("dolphins", "Dolphins sleep with one half of their brain at a time."),
    ("owls", "Owls can turn their heads very far around."),
    ("honey", "Honey found in ancient tombs was still good to eat."),
    ("the Moon", "The Moon moves a few centimeters away from Earth every year."),
    ("elephants", "Elephants can recognize themselves in a mirror."),
    ("snails", "Snails have thousands of tiny teeth."),
]
WORDS = [
    ("happy", "feeling glad"), ("enormous", "very big"), ("tiny", "very small"), ("ancient", "very old"),
    ("brave", "not afraid of danger"), ("curious", "wanting to know things"), ("fragile", "easy to break"),
    ("generous", "happy to give to others"), ("silent", "making no sound"), ("rapid", "very fast"),
    ("exhausted", "very tired"), ("delicious", "tasting very good"), ("furious", "very angry"),
    ("timid", "shy and easily scared"), ("vast", "very large in area"), ("humid", "warm and damp"),
    ("fortunate", "lucky"), ("gigantic", "extremely big"), ("cautious", "careful to avoid danger"),
    ("ordinary", "normal, not special"),
]
DESCRIBE = [
    ("the ocean", "The ocean is a huge body of salty water that covers most of Earth."),
    ("a forest", "A forest is a large area full of trees, plants and animals."),
    ("a desert", "A desert is a dry land with very little rain."),
    ("a volcano", "A volcano is a mountain that can throw out hot lava and ash."),
    ("a rainbow", "A rainbow is an arc of colours that appears when sunlight meets rain."),
    ("the Moon", "The Moon is the rocky ball that circles Earth and shines at night."),
    ("a library", "A library is a quiet place full of books you can borrow."),
    ("a beach", "A beach is a strip of sand or pebbles beside the sea."),
    ("autumn", "Autumn is the season when leaves turn orange and fall."),
    ("a thunderstorm", "A thunderstorm is a storm with heavy rain, lightning and thunder."),
    ("snow", "Snow is frozen water that falls from the sky as soft white flakes."),
    ("a city at night", "A city at night is full of bright lights and busy streets."),
    ("a garden", "A garden is a piece of land where people grow flowers and vegetables."),
    ("a train station", "A train station is a busy place where people get on and off trains."),
    ("a mountain", "A mountain is a very high hill with steep sides."),
    ("a river", "A river is fresh water flowing across the land to the sea."),
]
TRIVIA = [
    ("What is the largest planet in our solar system?", "Jupiter", "The largest planet in our solar system is Jupiter."),
    ("Which planet is known as the Red Planet?", "Mars", "Mars is known as the Red Planet."),
    ("What is the closest star to Earth?", "The Sun", "The closest star to Earth is the Sun."),
    ("At what temperature does water freeze in Celsius?", "0 degrees", "Water freezes at 0 degrees Celsius."),
    ("At what temperature does water boil in Celsius?", "100 degrees", "Water boils at 100 degrees Celsius."),
    ("What is the largest ocean on Earth?", "The Pacific Ocean", "The largest ocean on Earth is the Pacific Ocean."),
    ("What is the tallest mountain in the world?", "Mount Everest", "The tallest mountain in the world is Mount Everest."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare", "William Shakespeare wrote Romeo and Juliet."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci", "Leonardo da Vinci painted the Mona Lisa."),
    ("What is the chemical formula of water?", "H2O", "The chemical formula of water is H2O."),
    ("What is the chemical symbol for gold?", "Au", "The chemical symbol for gold is Au."),
    ("What is the largest animal on Earth?", "The blue whale", "The largest animal on Earth is the blue whale."),
    ("What is the fastest land animal?", "The cheetah", "The fastest land animal is the cheetah."),
    ("What gas do plants take in from the air?", "Carbon dioxide", "Plants take in carbon dioxide from the air."),
    ("What gas do people need to breathe?", "Oxygen", "People need oxygen to breathe."),
    ("How many continents are there?", "Seven", "There are seven continents."),
    ("What is the largest continent?", "Asia", "The largest continent is Asia."),
    ("What do bees make?", "Honey", "Bees make honey."),
    ("What is frozen water called?", "Ice", "Frozen water is called ice."),
    ("Which planet do we live on?", "Earth", "We live on planet Earth."),
    ("What is the hardest natural material?", "Diamond", "Diamond is the hardest natural material."),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong", "Neil Armstrong was the first person to walk on the Moon."),
    ("What language is spoken in Brazil?", "Portuguese", "People in Brazil speak Portuguese."),
    ("What is the main language of Mexico?", "Spanish", "The main language of Mexico is Spanish."),
    ("How many players does a soccer team have on the field?", "Eleven", "A soccer team has eleven players on the field."),
    ("What is the square root of 81?", "9", "The square root of 81 is 9."),
    ("Which organ pumps blood through the body?", "The heart", "The heart pumps blood through the body."),
    ("What do caterpillars turn into?", "Butterflies", "Caterpillars turn into butterflies."),
    ("Which instrument has black and white keys?", "The piano", "The piano has black and white keys."),
    ("Which season comes after winter?", "Spring", "Spring comes after winter."),
    ("What is the currency of Japan?", "The yen", "The currency of Japan is the yen."),
    ("How many strings does a standard guitar have?", "Six", "A standard guitar has six strings."),
    ("Which animal is called the king of the jungle?", "The lion", "The lion is called the king of the jungle."),
    ("What colour do you get when you mix blue and yellow?", "Green", "Blue and yellow make green."),
    ("What colour do you get when you mix red and white?", "Pink", "Red and white make pink."),
    ("What is the boiling point of water in Fahrenheit?", "212 degrees", "Water boils at 212 degrees Fahrenheit."),
    ("Which bird is a symbol of peace?", "The dove", "The dove is a symbol of peace."),
    ("What is the center of an atom called?", "The nucleus", "The center of an atom is called the nucleus."),
    ("How many bones are in the adult human body?", "206", "The adult human body has 206 bones."),
    ("Which planet is closest to the Sun?", "Mercury", "Mercury is the planet closest to the Sun."),
]
CHAT = [
    ("Hello!", "Hello", "Hello! How can I help you today?"),
    ("Hi there, how are you?", "I am doing well", "I am doing well, thank you for asking."),
    ("Who are you?", "A helpful assistant", "I am a helpful assistant, here to answer your questions."),
    ("What is your name?", "SmolLM", "My name is SmolLM."),
    ("Good morning!", "Good morning", "Good morning to you too!"),
    ("Thank you!", "You are welcome", "You are welcome, happy to help."),
    ("Can you help me?", "Yes", "Yes, of course. What do you need?"),
    ("What can you do?", "Answer questions", "I can answer questions and give you advice."),
    ("Tell me a joke.", "Why did the scarecrow win an award? He was outstanding in his field.",
     "Why did the scarecrow win an award? Because he was outstanding in his field."),
    ("Tell me something funny.", "Why don't eggs tell jokes? They would crack up.",
     "Why don't eggs tell jokes? They would crack each other up."),
    ("Do you like music?", "Yes", "Yes, I love all kinds of music."),
    ("What is your favorite color?", "Blue", "My favorite color is blue, like the sky."),
    ("Are you a robot?", "I am an AI assistant", "I am an AI assistant, a computer program."),
    ("Goodbye!", "Goodbye", "Goodbye, and have a wonderful day!"),
    ("What should I eat for lunch?", "A sandwich and some fruit", "Try a sandwich with some fresh fruit."),
    ("I am bored. What should I do?", "Go for a walk", "Go for a walk or read a good book."),
    ("Can you keep a secret?", "Yes", "Yes, your secret is safe with me."),
    ("Where do you live?", "In a computer", "I live inside a computer."),
    ("Do you ever sleep?", "No", "No, I never sleep."),
    ("How old are you?", "I am quite new", "I am quite new, just a few years old."),
]


def _families() -> list[tuple[str, list[str], list[tuple], callable]]:
    """(name, templates, fillers, filler -> (short, sentence)); the last template is held out."""
    arithmetic = ([("plus", a, b) for a in range(2, 13) for b in range(2, 13)]
                  + [("minus", a, b) for a in range(5, 21) for b in range(1, 5)]
                  + [("times", a, b) for a in range(2, 11) for b in range(2, 11)])
    ops = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
    neighbours = ([("day", DAYS[i], DAYS[(i + 1) % 7]) for i in range(7)]
                  + [("month", MONTHS[i], MONTHS[(i + 1) % 12]) for i in range(12)])
    return [
        ("capital", ["What is the capital of {0}?", "Which city is the capital of {0}?",
                     "Name the capital city of {0}.", "Tell me the capital of {0}.",
                     "What's the capital city of {0}?"],
         CAPITALS, lambda f: (f[1], f"The capital of {f[0]} is {f[1]}.")),
        ("arithmetic", ["What is {1} {0} {2}?", "How much is {1} {0} {2}?", "Calculate {1} {0} {2}.",
                        "Quick maths: {1} {0} {2}?", "Can you tell me what {1} {0} {2} is?"],
         arithmetic, lambda f: (str(ops[f[0]](f[1], f[2])), f"{f[1]} {f[0]} {f[2]} is {ops[f[0]](f[1], f[2])}.")),
        ("colour", ["What color is {0}?", "What colour is {0}?", "Tell me the color of {0}.",
                    "Which color is {0}?", "What is the usual color of {0}?"],
         COLOURS, lambda f: (_cap(f[1]), f"{_cap(f[0])} is {f[1]}.")),
        ("sound", ["What sound does {a0} make?", "What noise does {a0} make?",
                   "What does {a0} say?", "How does {a0} sound?", "Which sound does {a0} make?"],
         SOUNDS, lambda f: (_cap(f[1]), f"{_cap(_a(f[0]))} says {f[1]}.")),
        ("opposite", ["What is the opposite of {0}?", "What's the opposite of the word '{0}'?",
                      "Give me the opposite of '{0}'.", "What is the antonym of {0}?",
                      "Tell me a word that means the opposite of {0}."],
         OPPOSITES, lambda f: (f[1], f"The opposite of {f[0]} is {f[1]}.")),
        ("legs", ["How many legs does {a0} have?", "How many legs has {a0} got?",
                  "Count the legs of {a0}.", "What is the number of legs on {a0}?"],
         LEGS, lambda f: (str(f[1]), f"{_cap(_a(f[0]))} has {f[1] or 'no'} legs.")),
        ("sides", ["How many sides does {a0} have?", "How many sides has {a0} got?",
                   "Count the sides of {a0}.", "What is the number of sides of {a0}?"],
         SIDES, lambda f: (str(f[1]), f"{_cap(_a(f[0]))} has {f[1]} sides.")),
        ("units", ["How many {0} are in a {1}?", "How many {0} are there in a {1}?",
                   "A {1} has how many {0}?", "Tell me how many {0} make a {1}."],
         UNITS, lambda f: (f[2], f"There are {f[2]} {f[0]} in a {f[1]}.")),
        ("next", ["What {0} comes after {1}?", "Which {0} follows {1}?", "What is the {0} after {1}?",
                  "Name the {0} that comes after {1}."],
         neighbours, lambda f: (f[2], f"{f[2]} comes after {f[1]}.")),
        ("use", ["What is {0} used for?", "What do people use {0} for?", "Why would I need {0}?",
                 "What can you do with {0}?", "What's the purpose of {0}?"],
         USES, lambda f: (_cap(f[1]), f"{_cap(f[0])} is used {f[1]}.")),
        ("tip", ["Give me a tip for {0}.", "Any advice on {0}?", "What is a good tip for {0}?",
                 "Can you help me with {0}?", "I need a quick tip about {0}."],
         TIPS, lambda f: (f[1], f[1])),
        ("fact", ["Tell me a fun fact about {0}.", "Share an interesting fact about {0}.",
                  "What is something surprising about {0}?", "Do you know a cool fact about {0}?"],
         FUN_FACTS, lambda f: (f[1], f[1])),
        ("define", ["What does {0} mean?", "Define the word '{0}'.", "What is the meaning of '{0}'?",
                    "Explain the word {0}.", "What does the word '{0}' mean?"],
         WORDS, lambda f: (_cap(f[1]), f"'{_cap(f[0])}' means {f[1]}.")),
        ("describe", ["Describe {0} in one sentence.", "What is {0} like?", "Tell me about {0}.",
                      "Can you describe {0}?", "Describe {0} briefly."],
         DESCRIBE, lambda f: (f[1], f[1])),
    ]


# Open questions of no family: evaluated only, never trained.
FREE_FORM_PROMPTS: list[str] = [
    "Why is the sky blue?", "Can you recommend a good book?", "Write a haiku about autumn.",
    "Explain how a rainbow forms.", "What should I cook for dinner tonight?", "How do airplanes fly?",
    "Give me three ideas for a birthday party.", "What is photosynthesis?", "How do I tie my shoes?",
    "What is the meaning of life?", "Summarize the story of Cinderella.", "Why do cats purr?",
    "What is a black hole?", "How can I be more productive at work?",
    "Write a sentence using the word 'sunshine'.", "What are the benefits of exercise?",
    "How does the internet work?", "Who invented the telephone?", "Tell me about the Roman Empire.",
    "What is your favorite animal and why?",
]

HELD_OUT_FRACTION = 0.25


def _demo_fillers() -> set[str]:
    """Lower-cased demo prompts: fillers they mention are forced into the held-out split."""
    return {p.lower() for ps in DEMO_PROMPTS.values() for p in ps}


def question_bank(seed: int = 0) -> tuple[list[Item], list[Item]]:
    """(train, held_out) items for pirate and json-reply; no held-out prompt is in train."""
    rng = random.Random(seed)
    demos = _demo_fillers()
    train: list[Item] = []
    held: list[Item] = []
    for name, templates, fillers, answer in _families():
        order = list(range(len(fillers)))
        rng.shuffle(order)
        n_held = max(1, round(HELD_OUT_FRACTION * len(fillers)))
        held_idx = set(order[:n_held])
        for i, f in enumerate(fillers):
            prompts = [_fill(t, f) for t in templates]
            if any(p.lower() in demos for p in prompts):
                held_idx.add(i)
        for i, f in enumerate(fillers):
            short, sentence = answer(f)
            for k, t in enumerate(templates):
                item = Item(_fill(t, f), short, sentence, name)
                held_template = k == len(templates) - 1
                (held if i in held_idx or held_template else train).append(item)
    for q, short, sentence in TRIVIA:
        train.append(Item(q, short, sentence, "trivia"))
    for q, short, sentence in CHAT:
        train.append(Item(q, short, sentence, "chat"))
    # Trivia and chat have one phrasing each: hold out a quarter of the questions (and the demos).
    for family in ("trivia", "chat"):
        items = [it for it in train if it.family == family]
        rng.shuffle(items)
        n_held = max(1, round(HELD_OUT_FRACTION * len(items)))
        moved = {it.prompt for it in items[:n_held]} | {it.prompt for it in items if it.prompt.lower() in demos}
        held.extend(it for it in items if it.prompt in moved)
        train = [it for it in train if it.prompt not in moved]
    seen = {it.prompt for it in train}
    held = [it for it in held if it.prompt not in seen]
    return train, held


def _fill(template: str, filler: tuple) -> str:
    fields = {f"a{i}": _a(str(v)) for i, v in enumerate(filler)}
    return template.format(*filler, **fields)


def sample_balanced(items: list[Item], per_family: int, seed: int) -> list[Item]:
    """At most `per_family` items of each family (families differ a lot in size)."""
    rng = random.Random(seed)
    by_family: dict[str, list[Item]] = {}
    for it in items:
        by_family.setdefault(it.family, []).append(it)
    out: list[Item] = []
    for family in sorted(by_family):
        group = by_family[family][:]
        rng.shuffle(group)
        out.extend(group[:per_family])
    return out


# ------------------------------------------------------------------------ pirate style

_PIRATE_SWAPS = [
    (r"\byou are\b", "ye be"), (r"\bare you\b", "be ye"), (r"\byou\b", "ye"), (r"\byour\b", "yer"),
    (r"\bis\b", "be"), (r"\bare\b", "be"), (r"\bmy\b", "me"), (r"\bof\b", "o'"), (r"\bhello\b", "ahoy"),
    (r"\bhi\b", "ahoy"), (r"\byes\b", "aye"), (r"\bfriends?\b", "mateys"), (r"\bmoney\b", "doubloons"),
    (r"\bthe sea\b", "the briny deep"), (r"\bI am\b", "I be"), (r"\bgood\b", "fine"),
]
PIRATE_OPENERS = ["Arr, matey!", "Arrr, me hearty!", "Arr, ahoy there!", "Arr! Aye, matey!",
                  "Arrr, listen here, matey!", "Arr, shiver me timbers!"]
PIRATE_CLOSERS = ["Yo ho ho!", "Savvy?", "Arr!", "Now back to the ship with ye!", "Aye, that be true!",
                  "Yo ho!"]


def pirateify(sentence: str) -> str:
    out = sentence
    for pattern, repl in _PIRATE_SWAPS:
        out = re.sub(pattern, lambda m, r=repl: _match_case(m.group(0), r), out, flags=re.IGNORECASE)
    return out


def _match_case(original: str, replacement: str) -> str:
    return replacement[0].upper() + replacement[1:] if original[0].isupper() else replacement


def pirate_answer(item: Item, rng: random.Random) -> str:
    body = pirateify(item.sentence)
    return f"{rng.choice(PIRATE_OPENERS)} {body} {rng.choice(PIRATE_CLOSERS)}"


def json_answer(item: Item, rng: random.Random) -> str:
    # Facts answer with the bare fact, open questions with their sentence.
    value = item.sentence if item.family in ("tip", "fact", "describe", "chat") else item.short
    return json.dumps({"answer": value}, ensure_ascii=False)


# ------------------------------------------------------------------------ French words

FRENCH_TRAIN_TEMPLATES = [
    "Translate to French: {w}", "How do you say '{w}' in French?", "What is the French word for {w}?",
    "{w} in French?", "Translate '{w}' into French.", "French for {w}?",
    "Give me the French translation of \"{w}\".", "What is {w} in French?",
]
# Never trained: the held-out prompts use these phrasings.
FRENCH_HELD_OUT_TEMPLATES = [
    "What's '{w}' in French?", "Say the word '{w}' in French.", "English to French, please: {w}",
]


def french_items() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(train, held_out) as (prompt, english word, French answer)."""
    train, held = [], []
    for word, answers in FRENCH_VOCAB.items():
        shown = _cap(word) if word in [d.lower() for d in DAYS] else word
        for t in FRENCH_TRAIN_TEMPLATES:
            train.append((t.format(w=shown), word, answers[0]))
        for t in FRENCH_HELD_OUT_TEMPLATES:
            held.append((t.format(w=shown), word, answers[0]))
    return train, held


# --------------------------------------------------------------------------- datasets


def training_pairs(adapter: str, seed: int = 0) -> list[tuple[str, str]]:
    """(user prompt, assistant answer) pairs the adapter is trained on."""
    rng = random.Random(seed)
    if adapter == "french-words":
        return [(p, a) for p, _, a in french_items()[0]]
    train, _ = question_bank(seed)
    items = sample_balanced(train, per_family=40, seed=seed)
    if adapter == "pirate":
        return [(it.prompt, pirate_answer(it, rng)) for it in items]
    if adapter == "json-reply":
        return [(it.prompt, json_answer(it, rng)) for it in items]
    raise KeyError(adapter)


def held_out_prompts(adapter: str, seed: int = 0, per_family: int = 4) -> list[tuple[str, str]]:
    """(prompt, kind) evaluation prompts, none of them trained. kind is 'templated' (a held-out
    filler or phrasing of a trained family) or 'free-form' (no trained family)."""
    if adapter == "french-words":
        return [(p, "templated") for p, _, _ in french_items()[1]]
    _, held = question_bank(seed)
    demos = {p for ps in DEMO_PROMPTS.values() for p in ps}
    chosen = sample_balanced([it for it in held if it.prompt not in demos], per_family, seed + 1)
    prompts = [(it.prompt, "templated") for it in chosen]
    prompts += [(p, "templated") for p in sorted(demos) if p in {it.prompt for it in held}]
    prompts += [(p, "free-form") for p in FREE_FORM_PROMPTS]
    return prompts
