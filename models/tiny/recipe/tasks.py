"""Seeded generators of chat-format tasks with checkable answers for the embedded `tiny` model.

Each generator takes a `random.Random` and returns one item ``{"family", "prompt", "answer"}`` (all str).
The answer is exactly the text the model must produce (exact match after `.strip()`).

Letter tasks spell their word with spaces ("p l a n e t") so that every letter is its own token; the model then
only has to move tokens around, which a ~5M-parameter model can learn in minutes on 2 CPU cores.

Train/held-out split: an item is held out iff a hash of its prompt falls in the held-out bucket
(`is_heldout`), so the two splits are disjoint by construction whatever the seed.

Usage: ``python tasks.py --eval-out ../eval.jsonl`` writes the held-out eval set (fixed seed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Ada", "Ben", "Eva", "Max", "Zoe"]
ITEMS = ["apples", "books", "coins", "cards", "pens", "eggs", "shells", "stamps"]
WORDS = (
    "apple banana cherry grape lemon mango melon olive peach pear plum berry tiger horse zebra camel eagle "
    "otter panda koala mouse sheep goat whale shark robin raven river ocean cloud storm stone plant tree "
    "flower garden forest desert island valley planet rocket engine bridge castle tower window mirror candle "
    "pencil paper letter number silver golden purple orange yellow little simple bright gentle quick happy "
    "summer winter spring autumn morning evening music dance story dream light night house table chair "
    "bottle basket pocket jacket button rabbit turtle spider monkey donkey parrot dragon wizard knight "
    "school market city village road train plane boat ship car bike lamp clock phone radio camera"
).split()
SORT_WORDS = "ant bee cat dog elk fox gnu hen ibis jay kiwi lion mole newt owl pig quail rat seal toad".split()
UNITS = [  # (from, to, factor, max_value, long name of `to`)
    ("km", "m", 1000, 99, "meters"),
    ("m", "cm", 100, 99, "centimeters"),
    ("kg", "g", 1000, 99, "grams"),
    ("h", "min", 60, 24, "minutes"),
    ("min", "s", 60, 30, "seconds"),
    ("days", "h", 24, 20, "hours"),
]
UNIT_LONG = {"km": "kilometers", "m": "meters", "kg": "kilograms", "h": "hours", "min": "minutes", "days": "days"}


def spaced(word: str) -> str:
    """'planet' -> 'p l a n e t' (one token per letter)."""
    return " ".join(word)


def gen_add(rng: random.Random) -> dict:
    """2-digit addition, the canonical phrasing "What is A + B?"."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return {"family": "add", "prompt": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}."}


def gen_arith(rng: random.Random) -> dict:
    """Addition / subtraction with 1-3 digit operands and carries/borrows, several phrasings."""
    digits = rng.choice([2, 3, 3])
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(10, hi)
    if rng.random() < 0.5:
        a, b = max(a, b), min(a, b)
        res, op = a - b, "-"
        prompt = rng.choice([f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"Compute {a} - {b}."])
    else:
        res, op = a + b, "+"
        prompt = rng.choice([f"What is {a} + {b}?", f"Add {a} and {b}.", f"Compute {a} + {b}."])
    return {"family": "arith", "prompt": prompt, "answer": f"{a} {op} {b} = {res}."}


def gen_word_problem(rng: random.Random) -> dict:
    """Two-step word problem: start, gain, lose (or lose then gain); answer shows both steps."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    s1 = a + b
    c = rng.randint(1, s1)
    s2 = s1 - c
    prompt = (
        f"{name} has {a} {item}. {name} gets {b} more and then gives away {c}. How many {item} does {name} have now?"
    )
    return {"family": "word_problem", "prompt": prompt, "answer": f"{a} + {b} = {s1}. {s1} - {c} = {s2}."}


def pick_word(rng: random.Random) -> str:
    """A real word (half the time) or a random 3-8 letter string, so letter skills generalise."""
    if rng.random() < 0.5:
        return rng.choice(WORDS)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))


def gen_reverse(rng: random.Random) -> dict:
    """Reverse the letters of a word (spelled with spaces)."""
    w = pick_word(rng)
    return {"family": "reverse", "prompt": f"Reverse the letters: {spaced(w)}", "answer": spaced(w[::-1])}


def gen_sort_letters(rng: random.Random) -> dict:
    """Sort the letters of a word alphabetically."""
    w = pick_word(rng)
    return {"family": "sort_letters", "prompt": f"Sort the letters: {spaced(w)}", "answer": spaced("".join(sorted(w)))}


def gen_count_letter(rng: random.Random) -> dict:
    """Count how often a letter occurs in a word (the letter is present 1+ times, or absent)."""
    w = pick_word(rng)
    ch = rng.choice(w) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    return {
        "family": "count_letter",
        "prompt": f"How many times does {ch} appear in {spaced(w)}?",
        "answer": str(w.count(ch)),
    }


def gen_sort_words(rng: random.Random) -> dict:
    """Sort 3-5 short words alphabetically."""
    ws = rng.sample(SORT_WORDS, rng.randint(3, 5))
    return {"family": "sort_words", "prompt": "Sort these words: " + " ".join(ws), "answer": " ".join(sorted(ws))}


def gen_convert(rng: random.Random) -> dict:
    """Unit conversion by a fixed factor (km->m, h->min, ...)."""
    src, dst, factor, vmax, long = rng.choice(UNITS)
    v = rng.randint(2, vmax)
    prompt = rng.choice([f"How many {long} are in {v} {UNIT_LONG[src]}?", f"Convert {v} {src} to {dst}."])
    return {"family": "convert", "prompt": prompt, "answer": f"{v} {src} = {v * factor} {dst}."}


def gen_list(rng: random.Random) -> dict:
    """Counting up or down over 10-22 numbers: answers of ~40-90 tokens, i.e. 2-3 canvases of 32."""
    n = rng.randint(10, 22)
    a = rng.randint(10, 99 - n)
    b = a + n - 1
    if rng.random() < 0.5:
        prompt, seq = f"List the numbers from {a} to {b}.", range(a, b + 1)
    else:
        prompt, seq = f"Count down from {b} to {a}.", range(b, a - 1, -1)
    return {"family": "list", "prompt": prompt, "answer": ", ".join(str(x) for x in seq)}


GENERATORS = {
    "add": gen_add,
    "arith": gen_arith,
    "word_problem": gen_word_problem,
    "reverse": gen_reverse,
    "sort_letters": gen_sort_letters,
    "count_letter": gen_count_letter,
    "sort_words": gen_sort_words,
    "convert": gen_convert,
    "list": gen_list,
}
# Sampling weights for training (harder families get more).
WEIGHTS = {
    "add": 3.0,
    "arith": 1.5,
    "word_problem": 1.0,
    "reverse": 2.5,
    "sort_letters": 1.0,
    "count_letter": 1.0,
    "sort_words": 1.0,
    "convert": 1.0,
    "list": 1.0,
}
HELDOUT_PERCENT = 5


def is_heldout(prompt: str) -> bool:
    """True iff `prompt` belongs to the held-out split (sha256 bucket < HELDOUT_PERCENT of 100)."""
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def sample(rng: random.Random, heldout: bool = False, family: str | None = None) -> dict:
    """Draw one item from the train (default) or held-out split; `family` fixes the family.

    Rejection-samples on `is_heldout`, so the split is decided by the prompt alone.
    """
    fams, w = list(WEIGHTS), list(WEIGHTS.values())
    while True:
        fam = family or rng.choices(fams, w)[0]
        item = GENERATORS[fam](rng)
        if is_heldout(item["prompt"]) == heldout:
            return item


def make_eval(seed: int = 1234, per_family: int = 50) -> list[dict]:
    """Held-out eval set: `per_family` distinct held-out items per family (fewer if the family is small)."""
    rng = random.Random(seed)
    out = []
    for fam in GENERATORS:
        seen: set[str] = set()
        for _ in range(per_family * 200):
            if len(seen) >= per_family:
                break
            item = sample(rng, heldout=True, family=fam)
            if item["prompt"] not in seen:
                seen.add(item["prompt"])
                out.append(item)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-out", type=Path, default=Path(__file__).resolve().parent.parent / "eval.jsonl")
    ap.add_argument("--per-family", type=int, default=50)
    args = ap.parse_args()
    items = make_eval(per_family=args.per_family)
    args.eval_out.write_text("".join(json.dumps(it) + "\n" for it in items))
    print(f"wrote {len(items)} held-out items to {args.eval_out}")


if __name__ == "__main__":
    main()
