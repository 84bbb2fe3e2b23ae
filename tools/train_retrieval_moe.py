"""Train a small Mixtral-architecture MoE for long-context key-value retrieval.

The task (bench/retrieval_task.py): multi-query associative recall, key-value records among
filler text, then queries whose values must be copied. The model is `transformers`' own
MixtralForCausalLM from a seeded init, trained with loss only on the queries' values (plus
Mixtral's router load-balancing term). Input and output embeddings are tied: copying a value
is then one map through the shared embedding.

What the recipe does about the ways this task fails to train:
- queries name records drawn with replacement (in the task): asking each record once lets
  the last queries be answered by elimination, which lowers the training loss below that of
  copying some value of the context without any key matching;
- the length curriculum starts at 48 tokens, where records and queries are most of the row
  (little filler to dilute the first, weak attention to the right record), and the longest
  length doubles each time a probe at it reaches --advance-at, shorter rows staying in the mix;
- half the rows of a batch are copy rows (`copy_row`): random tokens, then chunks
  of them copied from random places, every copied token after a chunk's first supervised.
  Recall needs two heads that get gradient only through each other (in layer 0 each value
  takes in the key before it, in layer 1 the queried key matches that copy); the answers of
  recall rows are a few tokens a row, and the copy rows supervise the same circuit at most of
  their tokens. Copying whole halves at one offset would not do: a head attending at that
  fixed distance solves them without matching anything.

Progress runs from 0 to 1 over --max-steps, else over --max-minutes of --clock (wall clock, or
the process's CPU time), whatever comes first; the learning rate warms up, then follows a
cosine to a tenth. Every batch is a function of (seed, step, longest length), so a
--max-steps run is reproducible; a timed run records the step at which each longest length
was reached. The result JSON holds the loss curve, the probes and the final accuracy.

After training: the checkpoint (bf16 safetensors, config, tokenizer) and accuracy at each
--eval-lengths on --eval-count held-out examples (exact match of the value; greedy decoding
gives it exactly when the teacher-forced argmax is right, so one forward pass per example
measures it; in bf16 on a GPU).

    # CPU, one thread: 256 tokens (about 3 minutes of CPU time)
    PYTHONPATH=services:. python3 tools/train_retrieval_moe.py --device cpu --threads 1 --clock cpu \
        --max-minutes 20 --max-steps 1000 --eval-lengths 256 1024 --out /tmp/retrieval-moe-cpu \
        --result bench/results/train_retrieval_moe_cpu.json
    # one GPU: up to 8192 tokens (docs/retrieval.md has the run)
    PYTHONPATH=services:. python3 tools/train_retrieval_moe.py --device cuda --max-minutes 6.5 \
        --final-len 8192 --tokens-per-step 32768 --eval-lengths 2048 8192 --out OUT/retrieval-moe
    PYTHONPATH=services:. python3 tools/train_retrieval_moe.py --device cpu --tiny --out /tmp/r
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.retrieval_task import (  # noqa: E402
    EOS, ID, TRAIN_SEED_BASE, VOCAB, build_tokenizer, eval_examples, make_example)

WORDS = VOCAB[3:]  # keys, values and filler: what a copy row is made of


@dataclass(frozen=True)
class Curriculum:
    min_len: int = 48  # every batch's length is drawn log-uniformly from [min_len, longest]
    final_len: int = 8192
    # the longest length doubles when a probe at it scores this (retrieval must form at short
    # lengths first: a fixed schedule reaching long contexts before it has formed wastes the run)
    advance_at: float = 0.9
    max_records: int = 16
    max_queries: int = 16
    tokens_per_step: int = 4096
    copy_share: float = 0.5  # share of each batch's rows that are copy rows (copy_row)

    def most_records(self, length: int) -> int:
        return max(2, min(self.max_records, length // 6))


def batch_spec(curriculum: Curriculum, seed: int, step: int, longest: int) -> dict:
    """Length, records and queries of one step's batch (drawn from the step's own rng)."""
    rng = np.random.default_rng((TRAIN_SEED_BASE + seed, step))
    hi = max(curriculum.min_len, longest)
    length = int(round(math.exp(rng.uniform(math.log(curriculum.min_len), math.log(hi + 1))) / 16) * 16)
    length = max(length, curriculum.min_len)
    return {"seed": seed, "step": step, "length": length, "rows": max(1, curriculum.tokens_per_step // length),
            "most_records": curriculum.most_records(length), "max_queries": curriculum.max_queries,
            "copy_share": curriculum.copy_share}


def copy_row(rng: np.random.Generator, length: int, min_chunk: int = 2, max_chunk: int = 6
             ) -> tuple[np.ndarray, np.ndarray]:
    """A training row for the copying circuit recall uses: half the row random words, then
    chunks of min_chunk..max_chunk of them copied from random places of the first half.
    The mask marks every copied token but a chunk's first (which nothing predicts): each is
    the word after the earlier occurrence of the word before it, found by matching content,
    since the chunks sit at random distances from their sources."""
    half = length // 2
    first = rng.integers(len(VOCAB) - len(WORDS), len(VOCAB), half)
    parts, mask, n = [first], [np.zeros(half, dtype=bool)], half
    while n < length:
        size = int(rng.integers(min_chunk, max_chunk + 1))
        start = int(rng.integers(0, half - size + 1))
        parts.append(first[start:start + size])
        mask.append(np.arange(size) > 0)
        n += size
    return np.concatenate(parts)[:length].astype(np.int64), np.concatenate(mask)[:length]


def make_batch(spec: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids [rows, length], answer mask, length): each row from rng((seed, step, row))."""
    ids, masks = [], []
    num_copy = int(round(spec["copy_share"] * spec["rows"]))
    for row in range(spec["rows"]):
        rng = np.random.default_rng((TRAIN_SEED_BASE + spec["seed"], spec["step"], row))
        if row < num_copy:
            row_ids, row_mask = copy_row(rng, spec["length"])
            ids.append(row_ids)
            masks.append(row_mask)
            continue
        # many queries per row: each is a supervised answer (the loss sees nothing else)
        records = int(rng.integers(max(2, spec["most_records"] // 2), spec["most_records"] + 1))
        ex = make_example(rng, spec["length"], records, min(records, spec["max_queries"]))
        ids.append(ex.ids)
        masks.append(ex.answer_mask)
    return np.stack(ids), np.stack(masks), spec["length"]


class Batches:
    """The next batches, built ahead by worker processes (a GPU step is shorter than
    building its batch in Python) or inline (workers=0)."""

    def __init__(self, workers: int, depth: int):
        self.pool = ProcessPoolExecutor(workers) if workers > 0 else None
        self.depth = depth
        self.queue: list = []

    def get(self, next_spec) -> tuple[np.ndarray, np.ndarray, int]:
        """next_spec(k): the spec of the k-th batch from now, asked only for batches not yet queued."""
        if self.pool is None:
            return make_batch(next_spec(0))
        while len(self.queue) < self.depth:
            self.queue.append(self.pool.submit(make_batch, next_spec(len(self.queue))))
        return self.queue.pop(0).result()

    def close(self) -> None:
        if self.pool is not None:
            for f in self.queue:
                f.cancel()
            self.pool.shutdown(cancel_futures=True)


def build_model(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=len(VOCAB), hidden_size=args.hidden, intermediate_size=args.expert_intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=args.max_positions, rope_theta=args.rope_theta, rms_norm_eps=1e-6,
        sliding_window=None, tie_word_embeddings=True, router_aux_loss_coef=args.router_aux,
        output_router_logits=False, eos_token_id=ID[EOS], pad_token_id=ID[EOS], bos_token_id=None,
        initializer_range=0.02, attention_dropout=0.0,
    )
    torch.manual_seed(args.seed)
    return MixtralForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def lr_at(progress: float, step: int, args) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))  # cosine to a tenth
    return args.lr * warm * decay


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def accuracy(model, examples, device, batch_tokens: int) -> float:
    """Share of examples whose every answer digit is the argmax after the true prefix."""
    model.eval()
    right = 0
    rows = max(1, batch_tokens // len(examples[0].ids))
    for start in range(0, len(examples), rows):
        chunk = examples[start:start + rows]
        width = max(e.prompt_len + len(e.answer) for e in chunk)
        ids = torch.full((len(chunk), width), ID[EOS], dtype=torch.long)
        for r, e in enumerate(chunk):  # right-padded: causal attention never sees the padding
            n = e.prompt_len + len(e.answer)
            ids[r, :n] = torch.from_numpy(e.ids[:n])
        ids = ids.to(device)
        with autocast(device):
            logits = model(input_ids=ids).logits
        for r, e in enumerate(chunk):
            pred = logits[r, e.prompt_len - 1:e.prompt_len - 1 + len(e.answer)].argmax(-1).tolist()
            right += pred == e.answer
    model.train()
    return right / len(examples)


def evaluate(model, args, device, lengths, count: int, records: int | None = None) -> dict:
    out = {}
    for length in lengths:
        examples = eval_examples(args.seed, length, count, records or args.eval_records)
        out[str(length)] = accuracy(model, examples, device, args.eval_batch_tokens)
    return out


def train(args) -> dict:
    device = torch.device(args.device)
    curriculum = Curriculum(min_len=args.min_len, final_len=args.final_len, advance_at=args.advance_at,
                            max_records=args.max_records, max_queries=args.max_queries,
                            tokens_per_step=args.tokens_per_step, copy_share=args.copy_share)
    batches = Batches(args.workers, depth=2 * max(args.workers, 1))  # before CUDA starts: forked workers
    model = build_model(args).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98),
                            fused=device.type == "cuda")
    limit_s = args.max_minutes * 60
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    start = clock()
    progress_of = (lambda s, t: max(s / args.max_steps if args.max_steps else 0.0, t / limit_s))
    curve, evals, step, tokens = [], [], 0, 0
    longest = 2 * curriculum.min_len
    reached = {str(longest): 0}
    try:
        while True:
            elapsed = clock() - start
            progress = progress_of(step, elapsed)
            if progress >= 1.0:
                break
            ids, mask, length = batches.get(lambda k: batch_spec(curriculum, args.seed, step + k, longest))
            x = torch.from_numpy(ids).to(device, non_blocking=True)
            labels = torch.where(torch.from_numpy(mask).to(device), x, -100)
            for group in opt.param_groups:
                group["lr"] = lr_at(progress, step, args)
            with autocast(device):
                out = model(input_ids=x, labels=labels, output_router_logits=args.router_aux > 0)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += ids.size
            if step % args.log_every == 0:
                loss = float(out.loss.detach())
                curve.append({"step": step, "seconds": round(clock() - start, 1),
                              "progress": round(progress, 4), "length": length, "loss": round(loss, 4),
                              "lr": round(lr_at(progress, step, args), 6)})
                print(json.dumps(curve[-1]), flush=True)
            if step % args.probe_every == 0:
                probe = min(longest, curriculum.final_len)
                acc = evaluate(model, args, device, [probe], args.probe_count,
                               min(args.eval_records, curriculum.most_records(probe)))[str(probe)]
                evals.append({"step": step, "seconds": round(clock() - start, 1), "length": probe,
                              "accuracy": acc})
                print(json.dumps(evals[-1]), flush=True)
                if acc >= curriculum.advance_at and longest < curriculum.final_len:
                    longest = min(2 * longest, curriculum.final_len)
                    reached[str(longest)] = step
    finally:
        batches.close()
    train_s = clock() - start
    return {"model": model, "steps": step, "tokens": tokens, "train_seconds": round(train_s, 1),
            "tokens_per_second": round(tokens / max(train_s, 1e-9)), "curve": curve, "probe_evals": evals,
            "longest_reached_at_step": reached, "longest_final": longest, "curriculum": asdict(curriculum)}


def save(model, out_dir: Path, max_positions: int) -> None:
    """The checkpoint with its word-level tokenizer: tokenizer.json and tokenizer_config.json, the
    files the project's Tokenizer and transformers' AutoTokenizer read."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS,
              "pad_token": EOS, "unk_token": None, "model_max_length": max_positions}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--result", default=None, help="JSON of the run (default: OUT/../train_retrieval_moe.json)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="a few steps of a tiny model on short contexts: checks the script end to end")
    p.add_argument("--max-minutes", type=float, default=20.0, help="training time on --clock (saved when reached)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="what --max-minutes and the curve's seconds count: wall clock, or this process's CPU "
                        "time (with --threads 1, one thread's time whatever else runs on the machine)")
    p.add_argument("--max-steps", type=int, default=0, help="0: no step limit (wall clock only)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--workers", type=int, default=None, help="batch-building processes (default 6 on GPU, 0 on CPU)")
    # model
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=128)
    p.add_argument("--max-positions", type=int, default=16384)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--router-aux", type=float, default=0.02, help="Mixtral's load-balancing loss weight")
    # optimisation and curriculum
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--min-len", type=int, default=48)
    p.add_argument("--final-len", type=int, default=256)
    p.add_argument("--advance-at", type=float, default=0.9, help="probe accuracy that doubles the longest length")
    p.add_argument("--max-records", type=int, default=16)
    p.add_argument("--max-queries", type=int, default=16)
    p.add_argument("--copy-share", type=float, default=0.5, help="share of the rows that are copy rows")
    # evaluation
    p.add_argument("--eval-lengths", type=int, nargs="+", default=[256])
    p.add_argument("--eval-count", type=int, default=200)
    p.add_argument("--eval-records", type=int, default=16)
    p.add_argument("--probe-every", type=int, default=50, help="steps between accuracy probes at the longest length")
    p.add_argument("--probe-count", type=int, default=32)
    p.add_argument("--eval-batch-tokens", type=int, default=65536)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    if args.tiny:  # the same code path at toy size
        args.hidden, args.layers, args.heads, args.kv_heads = 64, 2, 2, 1
        args.experts, args.expert_intermediate = 4, 64
        args.min_len, args.final_len, args.max_records, args.max_queries, args.tokens_per_step = 32, 64, 2, 4, 1024
        args.eval_lengths, args.eval_count, args.eval_records, args.probe_count = [64], 64, 2, 16
        args.max_steps = args.max_steps or 12
        args.max_minutes = min(args.max_minutes, 1.0)
        args.log_every, args.warmup_steps, args.eval_batch_tokens = 10, 10, 4096
        args.probe_every, args.lr = 20, 1e-2
    if args.workers is None:
        args.workers = 6 if args.device.startswith("cuda") else 0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    run = train(args)
    model = run.pop("model")
    out_dir = Path(args.out)
    save(model, out_dir, args.max_positions)  # before the evaluation: a failing eval keeps the weights
    model.to(torch.float32 if args.device == "cpu" else torch.bfloat16)
    t0 = time.perf_counter()
    acc = evaluate(model, args, torch.device(args.device), args.eval_lengths, args.eval_count)
    run["eval_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"accuracy": acc}), flush=True)
    from bench.bench_meta import stamp

    params = sum(p.numel() for p in model.parameters())
    result = {"benchmark": "train_retrieval_moe", **stamp(), "args": vars(args), "parameters": params,
              "checkpoint_bytes": (out_dir / "model.safetensors").stat().st_size,
              "eval": {"records": args.eval_records, "examples": args.eval_count, "accuracy": acc,
                       "eval_dtype": "float32" if args.device == "cpu" else "bfloat16"},
              **run, "wall_seconds": round(time.time() - started, 1)}
    path = Path(args.result) if args.result else out_dir.parent / "train_retrieval_moe.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_dir} and {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
