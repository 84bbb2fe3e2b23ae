"""The synthetic long-context retrieval task: multi-query associative recall (MQAR, Zoology:
Arora et al. 2023) among filler text. Key-value records (a key word directly followed by its
value word) sit at sentence boundaries of random filler; after `query` come keys, each to be
answered with its value:

    the river is cold . k017 v042 a small bird sings . ... . query k017 v042 k101 v007

Keys and values are single tokens of their own vocabularies, so the answer is found by matching
the queried key against every record; a two-layer attention model solves it with an induction
circuit. The word-level tokenizer (`build_tokenizer`) splits on white space and `VOCAB` is its
vocabulary in id order, so text and ids agree. Examples are a pure function of (seed, index): a
held-out set is a seed no training batch uses (TRAIN_SEED_BASE, EVAL_SEED_BASE).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EOS = "<|endoftext|>"
QUERY, STOP = "query", "."
NUM_KEYS = NUM_VALUES = 64  # records per context stay well below: a key is found, not guessed
KEYS = tuple(f"k{i:03d}" for i in range(NUM_KEYS))
VALUES = tuple(f"v{i:03d}" for i in range(NUM_VALUES))
FILLER_WORDS = (
    "the", "a", "sky", "is", "blue", "grass", "green", "river", "flows", "past", "old", "mill", "small", "bird",
    "sings", "at", "dawn", "wind", "moves", "over", "hills", "cold", "rain", "falls", "on", "roof", "of", "house",
    "children", "play", "near", "quiet", "lake", "sun", "sets", "behind", "tall", "trees", "road", "winds",
    "through", "valley", "boat", "drifts", "slowly", "bright", "stars", "shine", "above", "town",
)
VOCAB = (EOS, QUERY, STOP, *KEYS, *VALUES, *FILLER_WORDS)
ID = {w: i for i, w in enumerate(VOCAB)}
KEY_IDS = np.array([ID[k] for k in KEYS])
VALUE_IDS = np.array([ID[v] for v in VALUES])
FILLER_IDS = np.array([ID[w] for w in FILLER_WORDS])
RECORD_LEN = 2  # key value (a query is the same pair, after the one word "query")
MIN_SENTENCE, MAX_SENTENCE = 3, 9  # filler words per sentence, before its "."
TRAIN_SEED_BASE = 1_000_000  # training batches: rng((TRAIN_SEED_BASE + seed, step, row))
EVAL_SEED_BASE = 2_000_000  # held-out examples: rng((EVAL_SEED_BASE + seed, length, index))


@dataclass
class Example:
    ids: np.ndarray  # int64 [length]: context, then the queries with their answers
    answer_mask: np.ndarray  # bool [length]: positions holding an answer (a queried value)
    prompt_len: int  # ids[:prompt_len] is the prompt of the first query ("... query K")
    answer: list[int]  # the first query's value id (what greedy decoding must produce)
    keys: list[int]  # every record's key id
    values: list[int]


def _filler(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n tokens of filler sentences and the offsets just after each "." (record slots)."""
    ids = FILLER_IDS[rng.integers(0, len(FILLER_IDS), n)]
    ends, pos = [], -1
    for length in rng.integers(MIN_SENTENCE, MAX_SENTENCE + 1, n // MIN_SENTENCE + 2):
        pos += int(length) + 1
        if pos >= n:
            break
        ids[pos] = ID[STOP]
        ends.append(pos + 1)
    ids[-1] = ID[STOP]  # the queries start a sentence
    return ids, np.array([0, *ends], dtype=np.int64)


def make_example(rng: np.random.Generator, length: int, num_records: int, num_queries: int = 1) -> Example:
    """A context of `length` tokens in all (queries and answers included): num_records records
    with distinct keys at random sentence boundaries, then num_queries queries of distinct
    records in random order, each followed by its value (dense: every second token of the
    query section is an answer, the only tokens a training loss can use)."""
    if num_records > NUM_KEYS:
        raise ValueError(f"{num_records} records need more than {NUM_KEYS} keys")
    filler_len = length - num_records * RECORD_LEN - 1 - num_queries * RECORD_LEN
    if filler_len < num_records:
        raise ValueError(f"length {length} is too short for {num_records} records and {num_queries} queries")
    keys = KEY_IDS[rng.choice(NUM_KEYS, num_records, replace=False)]
    values = VALUE_IDS[rng.integers(0, NUM_VALUES, num_records)]  # values may repeat: only the key decides
    filler, slots = _filler(rng, filler_len)
    cuts = np.sort(rng.choice(slots, num_records, replace=len(slots) < num_records))
    parts, prev = [], 0
    for cut, k, v in zip(cuts, keys, values):
        parts += [filler[prev:cut], np.array([k, v], dtype=np.int64)]
        prev = cut
    parts.append(filler[prev:])
    context = np.concatenate(parts)
    # each query names a record drawn independently: asking every record once would let the
    # last queries be answered by elimination (a value not yet asked), a shortcut that a
    # one-query evaluation cannot use and that competes with key matching in training
    asked = rng.integers(0, num_records, num_queries)
    queries = np.array([ID[QUERY], *np.stack([keys[asked], values[asked]], 1).ravel()], dtype=np.int64)
    ids = np.concatenate([context, queries])
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(context) + 2::RECORD_LEN] = True
    prompt_len = len(context) + 2
    return Example(ids, mask, prompt_len, [int(ids[prompt_len])], [int(k) for k in keys], [int(v) for v in values])


def eval_examples(seed: int, length: int, count: int, num_records: int) -> list[Example]:
    """The held-out set at one context length: one query each, prompt and answer."""
    return [make_example(np.random.default_rng((EVAL_SEED_BASE + seed, length, i)), length, num_records, 1)
            for i in range(count)]


def to_text(ids) -> str:
    return " ".join(VOCAB[int(i)] for i in ids)


def build_tokenizer():
    """The word-level tokenizer of VOCAB: one token per white-space separated word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([EOS])
    return tok
