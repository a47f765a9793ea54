"""Seeded synthetic English-like text and token ids for workloads (no datasets offline)."""

from __future__ import annotations

import random
from typing import Any

WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are have "
    "had not but were one all their there been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before "
    "must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three river city market energy "
    "water metal light sound field plant animal number system theory model process history "
    "law court trade crop price steel glass engine signal circuit cell protein language "
    "island mountain forest bridge harbor temple empire treaty army planet orbit comet"
).split()


def sentence(rng: random.Random, words: int) -> str:
    """``words`` random words, capitalised, ending with a full stop."""
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[:1].upper() + text[1:] + "."


def paragraph(rng: random.Random, sentences: int, words: tuple[int, int] = (8, 16)) -> str:
    return " ".join(sentence(rng, rng.randint(*words)) for _ in range(sentences))


def ordinary_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's ids that are not special or added tokens (safe for random prompts)."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return [i for i in range(len(tokenizer)) if i not in excluded]


def encode(tokenizer: Any, text: str, first: bool = False) -> tuple[int, ...]:
    """Token ids of ``text``; the tokenizer's BOS (where it adds one) only when ``first``."""
    return tuple(tokenizer(text, add_special_tokens=first).input_ids)
