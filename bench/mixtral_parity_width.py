"""Is the Mixtral-8x7B real-shape parity gap (bf16, 32 layers: argmax 1 of 16) the model or
rounding? Builds transformers' MixtralForCausalLM at the real width (hidden 4096, 8 experts
of 14336, 32/8 heads, vocab 32000, random init) with few layers on the CPU, assembles our
model over the same tensors (bench/real_shape.ours_from_hf) and compares logits in fp32
and bf16. Writes bench/results/mixtral_parity_width.json.

    .venv/bin/python -m bench.mixtral_parity_width [--layers-fp32 1] [--layers-bf16 1 2]
(1 fp32 layer holds about 7 GB of host memory.)
"""

from __future__ import annotations

import argparse
import gc

import torch

from bench import real_shape as rs
from bench.bench_meta import write_result
from pagedweight.format.model_config import ModelConfig


def one(dtype: torch.dtype, layers: int) -> dict:
    hf, raw = rs.build_hf_model("mixtral-8x7b", torch.device("cpu"), dtype, {"num_hidden_layers": layers})
    config = ModelConfig.from_dict(raw, source="mixtral-8x7b")
    ours = rs.ours_from_hf(hf, config)
    result = {"dtype": str(dtype).removeprefix("torch."), "layers": layers,
              **rs.parity(hf, ours, config.vocab_size, torch.device("cpu"))}
    del hf, ours
    gc.collect()
    print(result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers-fp32", nargs="*", type=int, default=[1])
    parser.add_argument("--layers-bf16", nargs="*", type=int, default=[1, 2])
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [one(torch.float32, n) for n in args.layers_fp32] + [one(torch.bfloat16, n) for n in args.layers_bf16]
    write_result("mixtral_parity_width", {"rows": rows})


if __name__ == "__main__":
    main()
