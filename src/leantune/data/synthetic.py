"""The instruction dataset bundled with leantune, generated here from a fixed seed.

Every example is a small task with one right answer (reverse a word, add two numbers, ...), so a
tiny model visibly learns it within a few hundred steps on a CPU. The records are written to
``assets/tiny_instructions.jsonl`` by ``python -m leantune.data.synthetic``; a test checks that the
committed file is exactly what this module generates.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Callable

ASSET_PATH = Path(__file__).parent / "assets" / "tiny_instructions.jsonl"
SEED = 20261202
NUM_EXAMPLES = 3000

WORDS = (
    "apple river stone cloud garden window orange silver forest bread candle market "
    "pencil rabbit yellow ocean button castle dragon mirror planet rocket tiger violin "
    "winter summer spring autumn bottle carpet desert engine feather guitar hammer island "
    "jacket kettle ladder magnet needle pepper pillow puzzle ribbon saddle shadow sugar "
    "table tunnel wagon basket blanket bridge camera cookie dinner finger flower hunter "
    "lemon marble meadow monkey napkin orbit parrot pocket rain robot salad school spider "
    "tomato turtle valley wallet zebra anchor arrow beach cactus canvas circle cotton "
    "falcon glove harbor honey jungle lantern lizard melon nest paper pirate quartz radio "
    "sandal shell socket storm thunder ticket timber tulip velvet walnut whale wizard"
).split()

OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("open", "closed"), ("light", "dark"), ("early", "late"), ("full", "empty"), ("hard", "soft"),
    ("high", "low"), ("new", "old"), ("rich", "poor"), ("strong", "weak"), ("wet", "dry"),
    ("long", "short"), ("loud", "quiet"), ("near", "far"), ("clean", "dirty"), ("first", "last"),
    ("inside", "outside"), ("push", "pull"), ("win", "lose"), ("true", "false"), ("day", "night"),
)

Record = dict[str, str]


def _reverse(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return {"instruction": "Reverse the letters of the word.", "input": word, "output": word[::-1]}


def _uppercase(rng: random.Random) -> Record:
    text = " ".join(rng.sample(WORDS, rng.randint(1, 3)))
    return {"instruction": "Rewrite the text in uppercase.", "input": text, "output": text.upper()}


def _add(rng: random.Random) -> Record:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    if rng.random() < 0.5:
        return {"instruction": f"What is {a} plus {b}?", "input": "", "output": str(a + b)}
    return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}


def _sort(rng: random.Random) -> Record:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    return {
        "instruction": "Sort the numbers from smallest to largest.",
        "input": " ".join(map(str, numbers)),
        "output": " ".join(map(str, sorted(numbers))),
    }


def _count_letters(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return {"instruction": "How many letters are in the word?", "input": word, "output": str(len(word))}


def _opposite(rng: random.Random) -> Record:
    pair = rng.choice(OPPOSITES)
    word, answer = pair if rng.random() < 0.5 else pair[::-1]
    return {"instruction": "Give the opposite of the word.", "input": word, "output": answer}


def _repeat(rng: random.Random) -> Record:
    word, times = rng.choice(WORDS), rng.randint(2, 4)
    spelled = {2: "two", 3: "three", 4: "four"}[times]
    return {"instruction": f"Repeat the word {spelled} times.", "input": word, "output": " ".join([word] * times)}


def _next_in_sequence(rng: random.Random) -> Record:
    start, step = rng.randint(0, 20), rng.randint(1, 9)
    terms = [start + step * i for i in range(4)]
    return {
        "instruction": "What number comes next in the sequence?",
        "input": ", ".join(map(str, terms)),
        "output": str(start + step * 4),
    }


def _first_letter(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return {"instruction": "What is the first letter of the word?", "input": word, "output": word[0]}


def _plural(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    if word.endswith(("s", "x", "sh", "ch", "z")):
        plural = word + "es"
    elif word.endswith("y") and word[-2] not in "aeiou":
        plural = word[:-1] + "ies"
    else:
        plural = word + "s"
    return {"instruction": "Write the plural of the noun.", "input": word, "output": plural}


TASKS: tuple[Callable[[random.Random], Record], ...] = (
    _reverse, _uppercase, _add, _sort, _count_letters,
    _opposite, _repeat, _next_in_sequence, _first_letter, _plural,
)


def generate(num_examples: int = NUM_EXAMPLES, seed: int = SEED) -> list[Record]:
    """Return ``num_examples`` distinct Alpaca-style records, the same list for the same seed.

    Tasks take turns; a task whose few possible records are used up (there are only so many words
    to reverse) gives up its turn, so no record repeats and validation never sees a training record.
    """
    rng = random.Random(seed)
    seen: set[tuple[str, str, str]] = set()
    records: list[Record] = []
    turn = 0
    while len(records) < num_examples:
        task = TASKS[turn % len(TASKS)]
        turn += 1
        for _ in range(20):
            record = task(rng)
            key = (record["instruction"], record["input"], record["output"])
            if key not in seen:
                seen.add(key)
                records.append(record)
                break
    return records


def write(path: Path = ASSET_PATH) -> None:
    lines = "".join(json.dumps(record, sort_keys=True) + "\n" for record in generate())
    path.write_text(lines, encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSET_PATH)
