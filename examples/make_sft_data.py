"""Writes ``examples/sft.jsonl``: 400 small instruction / answer pairs (prompt-completion
format, as TRL's SFTTrainer reads it) over words from Python's own keyword and builtin names,
made by rule so the answers are right. Deterministic (seed 0); the file ships with the repo.

    python examples/make_sft_data.py
"""

from __future__ import annotations

import builtins
import json
import keyword
import random
from pathlib import Path

WORDS = sorted({w for w in dir(builtins) + keyword.kwlist if w.isalpha() and w.islower() and len(w) > 2})


def _task(rng: random.Random) -> dict[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        w = rng.choice(WORDS)
        return dict(prompt=f"Reverse the word '{w}'.\n", completion=f"{w[::-1]}\n")
    if kind == 1:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return dict(prompt=f"What is {a} plus {b}?\n", completion=f"{a} + {b} = {a + b}\n")
    if kind == 2:
        ws = rng.sample(WORDS, rng.randrange(3, 7))
        return dict(prompt=f"Sort alphabetically: {', '.join(ws)}.\n", completion=f"{', '.join(sorted(ws))}\n")
    if kind == 3:
        w = rng.choice(WORDS)
        n = sum(c in "aeiou" for c in w)
        return dict(prompt=f"How many vowels are in '{w}'?\n", completion=f"'{w}' has {n} vowel{'s' * (n != 1)}.\n")
    if kind == 4:
        ws = rng.sample(WORDS, rng.randrange(2, 6))
        return dict(prompt=f"Write in capitals: {' '.join(ws)}\n", completion=f"{' '.join(ws).upper()}\n")
    xs = [rng.randrange(100) for _ in range(rng.randrange(3, 9))]
    return dict(prompt=f"Largest of {xs}?\n", completion=f"The largest is {max(xs)}.\n")


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).resolve().parent / "sft.jsonl"
    out.write_text("".join(json.dumps(_task(rng)) + "\n" for _ in range(400)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
