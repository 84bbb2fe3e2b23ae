"""Batch-1 decode speed: our model against Hugging Face `transformers`, same CPU, same run.

For each model: a 32-token prompt, 128 greedy new tokens, fp32, one warm-up, then the
median of 3 timed runs for each implementation, interleaved so machine noise hits both.
Writes bench/results/decode_speed_cpu.json.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.bench_meta import arg_parser, seconds, write_result
from pagedweight.engine.generate import generate
from pagedweight.engine.sampler import SamplingParams
from pagedweight.common.paths import shared_models_dir
from pagedweight.model import load_model

SHARED = shared_models_dir()
MODELS = ("micro-mixtral", "tiny-qwen-moe")
NEW_TOKENS, RUNS = 128, 3


def bench_model(model_dir: Path, new_tokens: int = NEW_TOKENS) -> dict:
    ours = load_model(model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.randint(1, ours.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    def run_ours():
        assert len(generate(ours, prompt, params).token_ids) == new_tokens

    @torch.inference_mode()
    def run_reference():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(prompt) + new_tokens

    run_ours(), run_reference()  # warm-up
    ours_s, ref_s = [], []
    for _ in range(RUNS):
        ours_s.append(seconds(run_ours))
        ref_s.append(seconds(run_reference))
    ours_tps = new_tokens / statistics.median(ours_s)
    ref_tps = new_tokens / statistics.median(ref_s)
    return {"model": model_dir.name, "new_tokens": new_tokens, "prompt_tokens": len(prompt),
            "pagedweight_tokens_per_s": round(ours_tps, 1),
            "transformers_tokens_per_s": round(ref_tps, 1),
            "speedup": round(ours_tps / ref_tps, 2),
            "pagedweight_runs_s": [round(s, 3) for s in ours_s],
            "transformers_runs_s": [round(s, 3) for s in ref_s]}


def main() -> None:
    arg_parser(__doc__).parse_args()
    rows = [bench_model(SHARED / name) for name in MODELS]
    for row in rows:
        print(f"{row['model']:>14}: ours {row['pagedweight_tokens_per_s']:7.1f} tok/s, "
              f"transformers {row['transformers_tokens_per_s']:7.1f} tok/s, x{row['speedup']}")
    print(write_result("decode_speed", {"dtype": "float32", "batch_size": 1, "results": rows}))


if __name__ == "__main__":
    main()
