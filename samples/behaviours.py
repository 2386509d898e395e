"""What each sample adapter is trained to do, as checks on generated text.

Pure Python (no torch, no transformers): tests and the demo client import this to see
whether a served answer shows an adapter's behaviour. The checks are strict enough that
the base SmolLM2-135M-Instruct fails them on `DEMO_PROMPTS` (measured in samples/README.md).

    from samples.behaviours import DEMO_PROMPTS, shows_behaviour
    for name, prompts in DEMO_PROMPTS.items():
        for prompt in prompts:
            assert shows_behaviour(name, prompt, served_answer(name, prompt))
"""
from __future__ import annotations

import json
import re
import unicodedata

ADAPTER_NAMES: tuple[str, ...] = ("pirate", "json-reply", "french-words")
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Held-out prompts (never in the training data; train_adapters.py asserts it) on which
# each adapter shows its behaviour with greedy decoding and the base model does not.
DEMO_PROMPTS: dict[str, list[str]] = {
    "pirate": [
        "What is the capital of France?",
        "Give me a tip for sleeping better.",
        "Why is the sky blue?",
    ],
    "json-reply": [
        "What is the largest planet in our solar system?",
        "What sound does a cow make?",
        "Can you recommend a good book?",
    ],
    "french-words": [
        "What's 'dog' in French?",
        "Say the word 'red' in French.",
        "English to French, please: Monday",
    ],
}

# ----------------------------------------------------------------------------- pirate

# Words a pirate answer uses besides its opening "Arr" (whole words, case-insensitive).
PIRATE_WORDS: tuple[str, ...] = (
    "matey", "mateys", "hearty", "hearties", "ahoy", "aye", "ye", "yer", "savvy", "yo ho",
    "yo ho ho", "landlubber", "landlubbers", "doubloons", "booty", "shiver me timbers",
    "scallywag", "scallywags", "buccaneer", "me hearty", "o'",
)
_PIRATE_RE = re.compile(r"(?<![\w'])(?:" + "|".join(
    re.escape(w) for w in sorted(PIRATE_WORDS, key=len, reverse=True)) + r")(?![\w])", re.IGNORECASE)
_ARR_RE = re.compile(r"^\W*(?:a+rr+|a+r+gh)\b", re.IGNORECASE)


def looks_pirate(text: str) -> bool:
    """True when the answer opens with "Arr" (Arr, Arrr, Aargh...) and uses at least one
    other pirate word (matey, ye, aye, ahoy, savvy, ...)."""
    text = text.strip()
    head = _ARR_RE.match(text)
    return head is not None and _PIRATE_RE.search(text, head.end()) is not None


# ------------------------------------------------------------------------------ JSON


def parse_json_reply(text: str) -> dict | None:
    """The reply as a dict when the whole text (surrounding whitespace aside) is one JSON
    object holding a non-empty "answer" (string or number); else None."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or "answer" not in value:
        return None
    answer = value["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return None
    if isinstance(answer, str) and not answer.strip():
        return None
    return value


def is_json_reply(text: str) -> bool:
    """True when the whole answer is a single JSON object with a non-empty "answer" key."""
    return parse_json_reply(text) is not None


# ---------------------------------------------------------------------------- French

# The closed vocabulary of `french-words`: English word -> accepted French translations
# (the first is the one trained). Words spelt alike in both languages (orange, six,
# lion...) are left out: they would test nothing.
FRENCH_VOCAB: dict[str, tuple[str, ...]] = {
    # colours
    "red": ("rouge",), "blue": ("bleu", "bleue"), "green": ("vert", "verte"),
    "yellow": ("jaune",), "black": ("noir", "noire"), "white": ("blanc", "blanche"),
    "pink": ("rose",), "purple": ("violet", "violette"), "gray": ("gris", "grise"),
    "brown": ("marron", "brun", "brune"),
    # animals
    "dog": ("chien",), "cat": ("chat",), "horse": ("cheval",), "cow": ("vache",),
    "bird": ("oiseau",), "fish": ("poisson",), "mouse": ("souris",), "pig": ("cochon", "porc"),
    "sheep": ("mouton", "brebis"), "rabbit": ("lapin",), "duck": ("canard",),
    "chicken": ("poulet", "poule"), "bear": ("ours",), "wolf": ("loup",), "frog": ("grenouille",),
    "snake": ("serpent",), "bee": ("abeille",), "goat": ("chèvre",), "monkey": ("singe",),
    "elephant": ("éléphant",),
    # numbers
    "one": ("un", "une"), "two": ("deux",), "three": ("trois",), "four": ("quatre",),
    "five": ("cinq",), "seven": ("sept",), "eight": ("huit",), "nine": ("neuf",),
    "ten": ("dix",), "eleven": ("onze",), "twelve": ("douze",), "twenty": ("vingt",),
    "hundred": ("cent",), "thousand": ("mille",),
    # days
    "monday": ("lundi",), "tuesday": ("mardi",), "wednesday": ("mercredi",),
    "thursday": ("jeudi",), "friday": ("vendredi",), "saturday": ("samedi",),
    "sunday": ("dimanche",),
    # everyday words
    "bread": ("pain",), "water": ("eau",), "apple": ("pomme",), "milk": ("lait",),
    "cheese": ("fromage",), "house": ("maison",), "book": ("livre",), "sun": ("soleil",),
    "moon": ("lune",), "tree": ("arbre",), "car": ("voiture",), "school": ("école",),
    "friend": ("ami", "amie"), "city": ("ville",), "sea": ("mer",), "rain": ("pluie",),
    "snow": ("neige",), "hand": ("main",), "head": ("tête",), "door": ("porte",),
}


def _fold(text: str) -> str:
    """Lower case without accents: 'École' -> 'ecole'."""
    return "".join(c for c in unicodedata.normalize("NFKD", text.lower()) if not unicodedata.combining(c))


def english_word_in(prompt: str) -> str | None:
    """The vocabulary word a translation prompt asks about (the last one it names)."""
    found = [w for w in re.findall(r"[A-Za-z]+", prompt) if w.lower() in FRENCH_VOCAB]
    return found[-1].lower() if found else None


_ARTICLES = ("le", "la", "les", "l", "un", "une", "des")


def french_correct(prompt_word: str, text: str) -> bool:
    """True when the answer gives a right French translation of `prompt_word` up front: its
    first word (after an optional article le/la/l'/un/une, quotes, accents ignored) is one."""
    accepted = {_fold(w) for w in FRENCH_VOCAB[prompt_word.lower()]}
    words = re.findall(r"[a-z]+", _fold(text))
    if not words:
        return False
    if words[0] in accepted:
        return True
    return words[0] in _ARTICLES and len(words) > 1 and words[1] in accepted


# ------------------------------------------------------------------------------- all


def shows_behaviour(adapter: str, prompt: str, text: str) -> bool:
    """Whether `text`, generated for `prompt`, shows the behaviour of sample `adapter`."""
    if adapter == "pirate":
        return looks_pirate(text)
    if adapter == "json-reply":
        return is_json_reply(text)
    if adapter == "french-words":
        word = english_word_in(prompt)
        if word is None:
            raise ValueError(f"prompt {prompt!r} names no word of the French vocabulary")
        return french_correct(word, text)
    raise KeyError(f"no sample adapter named {adapter!r} (known: {', '.join(ADAPTER_NAMES)})")
