"""The synthetic long-context retrieval task: key-value records among distractor text.

A context is filler sentences (random words of a small word list, no digits) with
key-value records inserted at sentence boundaries:

    the river is cold . key 482 value 1937 . a small bird sings . ... query 482 value

The model must answer with the value's digits (`1 9 3 7`). Digits occur only in records
and queries, so the value is found by matching the whole key, not by spotting a number:
the other records are the hard distractors, the filler the long ones. Text and token ids
agree by construction: the word-level tokenizer (`build_tokenizer`) splits on white space
and into single digits, and `VOCAB` is its vocabulary in id order.

Examples are a pure function of (seed, index), so a held-out set is a seed no training
batch uses (training draws from TRAIN_SEED_BASE + seed; evaluation from EVAL_SEED_BASE + seed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
DIGITS = tuple(str(d) for d in range(10))
KEY, VALUE, QUERY, STOP = "key", "value", "query", "."
FILLER_WORDS = (
    "the", "a", "sky", "is", "blue", "grass", "green", "river", "flows", "past", "old", "mill", "small", "bird",
    "sings", "at", "dawn", "wind", "moves", "over", "hills", "cold", "rain", "falls", "on", "roof", "of", "house",
    "children", "play", "near", "quiet", "lake", "sun", "sets", "behind", "tall", "trees", "road", "winds",
    "through", "valley", "boat", "drifts", "slowly", "bright", "stars", "shine", "above", "town",
)
VOCAB = (EOS, *DIGITS, KEY, VALUE, QUERY, STOP, *FILLER_WORDS)
ID = {w: i for i, w in enumerate(VOCAB)}
DIGIT_IDS = np.array([ID[d] for d in DIGITS])
FILLER_IDS = np.array([ID[w] for w in FILLER_WORDS])
TRAIN_SEED_BASE = 1_000_000  # training batches: rng((TRAIN_SEED_BASE + seed, step, row))
EVAL_SEED_BASE = 2_000_000  # held-out examples: rng((EVAL_SEED_BASE + seed, length, index))


@dataclass(frozen=True)
class TaskShape:
    key_digits: int = 3
    value_digits: int = 4
    min_sentence: int = 3  # filler words per sentence, before its "."
    max_sentence: int = 9


@dataclass
class Example:
    ids: np.ndarray  # int64 [length]: context, then the queries with their answers
    answer_mask: np.ndarray  # bool [length]: positions holding an answer digit
    prompt_len: int  # ids[:prompt_len] is the prompt of the first query ("... query K value")
    answer: list[int]  # the first query's value ids (what greedy decoding must produce)
    keys: list[tuple[int, ...]]  # every record's key digits
    values: list[tuple[int, ...]]


def record_len(shape: TaskShape) -> int:
    return 1 + shape.key_digits + 1 + shape.value_digits + 1  # key K value V .


def _filler(rng: np.random.Generator, n: int, shape: TaskShape) -> tuple[np.ndarray, np.ndarray]:
    """n tokens of filler sentences and the offsets just after each "." (record slots)."""
    ids = FILLER_IDS[rng.integers(0, len(FILLER_IDS), n)]
    ends, pos = [], -1
    lengths = rng.integers(shape.min_sentence, shape.max_sentence + 1, n // shape.min_sentence + 2)
    for length in lengths:
        pos += int(length) + 1
        if pos >= n:
            break
        ids[pos] = ID[STOP]
        ends.append(pos + 1)
    ids[-1] = ID[STOP]  # the queries start a sentence
    return ids, np.array([0, *ends], dtype=np.int64)


def make_example(rng: np.random.Generator, length: int, num_records: int, num_queries: int = 1,
                 shape: TaskShape = TaskShape()) -> Example:
    """A context of about `length` tokens in all (queries and answers included): num_records
    records with distinct keys at random sentence boundaries, then num_queries queries of
    distinct records in random order, each followed by its value and "."."""
    rec = record_len(shape)
    num_queries = min(num_queries, num_records)
    if num_records > 10 ** shape.key_digits:
        raise ValueError(f"{num_records} records need more than {shape.key_digits}-digit keys")
    filler_len = length - num_records * rec - num_queries * rec
    if filler_len < num_records:
        raise ValueError(f"length {length} is too short for {num_records} records and {num_queries} queries")
    codes = rng.choice(10 ** shape.key_digits, num_records, replace=False)
    keys = [tuple(int(c) // 10 ** (shape.key_digits - 1 - i) % 10 for i in range(shape.key_digits)) for c in codes]
    values = [tuple(int(d) for d in rng.integers(0, 10, shape.value_digits)) for _ in range(num_records)]
    filler, slots = _filler(rng, filler_len, shape)
    cuts = np.sort(rng.choice(slots, num_records, replace=len(slots) < num_records))
    parts, prev = [], 0
    for cut, k, v in zip(cuts, keys, values):
        parts += [filler[prev:cut], _record(KEY, k, v)]
        prev = cut
    parts.append(filler[prev:])
    context = np.concatenate(parts)
    asked = rng.choice(num_records, num_queries, replace=False)
    queries = [_record(QUERY, keys[i], values[i]) for i in asked]
    ids = np.concatenate([context, *queries])
    mask = np.zeros(len(ids), dtype=bool)
    for q in range(num_queries):
        start = len(context) + q * rec + 1 + shape.key_digits + 1
        mask[start:start + shape.value_digits] = True
    prompt_len = len(context) + 1 + shape.key_digits + 1
    return Example(ids, mask, prompt_len, [int(x) for x in ids[prompt_len:prompt_len + shape.value_digits]],
                   keys, values)


def _record(head: str, key: tuple[int, ...], value: tuple[int, ...]) -> np.ndarray:
    return np.array([ID[head], *DIGIT_IDS[list(key)], ID[VALUE], *DIGIT_IDS[list(value)], ID[STOP]], dtype=np.int64)


def eval_examples(seed: int, length: int, count: int, num_records: int,
                  shape: TaskShape = TaskShape()) -> list[Example]:
    """The held-out set at one context length: one query each, prompt and answer."""
    return [make_example(np.random.default_rng((EVAL_SEED_BASE + seed, length, i)), length, num_records, 1, shape)
            for i in range(count)]


def to_text(ids) -> str:
    """The example as text: digits of one number written together ("key 482 value 1937 .")."""
    out: list[str] = []
    for i in ids:
        word = VOCAB[int(i)]
        if word in DIGITS and out and out[-1][-1].isdigit():
            out[-1] += word
        else:
            out.append(word)
    return " ".join(out)


def build_tokenizer():
    """The word-level tokenizer of VOCAB: white space, then every digit its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([EOS])
    return tok


def save_tokenizer(model_dir: Path, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json, the files the project's Tokenizer and
    transformers' AutoTokenizer read."""
    model_dir = Path(model_dir)
    build_tokenizer().save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS,
              "pad_token": EOS, "unk_token": None, "model_max_length": max_length}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
