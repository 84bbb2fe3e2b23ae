"""Calibration statistics against a direct computation from the routing observer."""

import torch
import torch.nn.functional as F

from pagedweight.offline.calibrate import CalibConfig, block_hessians, calibrate, smoothed_hessians
from pagedweight.model import load_model
from pagedweight.frontend.tokenizer import Tokenizer
from tests.conftest import BUNDLED_MODEL
from tests.offline.conftest import CALIB_TEXT


def test_recorded_statistics_match_the_routed_inputs():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    ids = Tokenizer(BUNDLED_MODEL).encode(CALIB_TEXT["bible"] + CALIB_TEXT["code"])
    T = 32
    chunks = [ids[i * T:(i + 1) * T] for i in range(3)]
    seen = {}  # layer -> (x, topk_ids, topk_weights) of the one batch
    block = model.moe_blocks[1]
    block.observer = lambda layer, x, ids_, w: seen.setdefault(layer, (x.clone(), ids_.clone(), w.clone()))
    with torch.inference_mode():
        reference = model(torch.tensor(chunks))
    stats = calibrate(model, chunks, ["a", "a", "b"], CalibConfig(seq_len=T, max_tokens_per_file=T))
    block.observer = None
    with torch.inference_mode():  # recording left the model's output unchanged and restored the experts
        assert torch.equal(model(torch.tensor(chunks)), reference)

    x, topk_ids, topk_w = seen[1]
    experts = block.experts
    for e in (0, 3, 7):
        for chunk in range(3):
            rows = torch.arange(chunk * T, (chunk + 1) * T)
            hit = (topk_ids[rows] == e).any(-1)
            xe = x[rows][hit]
            gate, up = F.linear(xe, experts.gate_up[e]).chunk(2, -1)
            act = F.silu(gate) * up
            assert stats.token_counts[chunk, 1, e] == hit.sum()
            assert torch.allclose(stats.sum_sq_gate_up[chunk, 1, e], xe.square().sum(0), rtol=1e-4, atol=1e-5)
            assert torch.allclose(stats.sum_sq_down[chunk, 1, e], act.square().sum(0), rtol=1e-4, atol=1e-5)
            mass = (topk_w[rows] * (topk_ids[rows] == e)).sum()
            assert torch.allclose(stats.routing_mass[chunk, 1, e], mass, rtol=1e-5)
    assert torch.all(stats.token_counts.sum((0, 2)) == 3 * T * model.config.num_experts_per_tok)
    h_gate_up, h_down = block_hessians(stats, CalibConfig(seq_len=T, max_tokens_per_file=T))
    assert h_gate_up.shape == (4, 8, 128) and (h_gate_up > 0).all() and (h_down > 0).all()


def test_smoothing_pulls_rare_experts_to_the_layer_and_leaves_busy_ones():
    sum_sq = torch.zeros(1, 3, 4)  # one layer, three experts, four columns
    sum_sq[0, 0] = torch.tensor([4.0, 8.0, 12.0, 16.0]) * 1000  # expert 0: 1000 tokens
    counts = torch.tensor([[1000.0, 0.0, 2.0]])
    sum_sq[0, 2] = torch.tensor([100.0, 0.0, 0.0, 0.0])  # expert 2: two odd tokens
    h = smoothed_hessians(sum_sq, counts, prior_tokens=16, per_column_prior=True)
    layer_mean = sum_sq[0].sum(0) / counts.sum()
    assert torch.allclose(h[0, 1], layer_mean)  # unseen expert: the layer's statistics
    assert torch.allclose(h[0, 0], torch.tensor([4.0, 8.0, 12.0, 16.0]), rtol=0.02)
    assert (h[0, 2, 1:] > 0).all()  # no zero weights for columns two tokens never excited


def test_output_gradients_add_up_to_the_moe_output_gradient():
    """Each routed copy of a token sees dL/d(block output), so summed over experts the
    recorded squared gradients of `down` are k times those of the block output."""
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    ids = Tokenizer(BUNDLED_MODEL).encode(CALIB_TEXT["bible"])
    T = 32
    chunks = [ids[i * T:(i + 1) * T] for i in range(2)]
    config = CalibConfig(seq_len=T, max_tokens_per_file=T, gradients=True)
    stats = calibrate(model, chunks, ["a", "a"], config)

    grads = {}  # layer -> dL/d(MoE block output)

    def keep_grad(layer):
        def hook(module, args, out):
            out.register_hook(lambda g: grads.__setitem__(layer, g))
        return hook

    hooks = [block.register_forward_hook(keep_grad(i)) for i, block in enumerate(model.moe_blocks)]
    batch = torch.tensor(chunks)
    for p in model.parameters():
        p.requires_grad_(False)
    embed_hook = model.embed_tokens.register_forward_hook(lambda m, a, out: out.requires_grad_(True))
    logits = model(batch)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").backward()
    for h in hooks + [embed_hook]:
        h.remove()
    k = model.config.num_experts_per_tok
    for layer in (0, 3):
        expected = k * grads[layer].reshape(-1, grads[layer].shape[-1]).square().sum(0)
        assert torch.allclose(stats.grad_sq_down[layer].sum(0), expected, rtol=1e-3, atol=1e-9)
        assert (stats.grad_sq_gate_up[layer] >= 0).all() and stats.grad_sq_gate_up[layer].sum() > 0
    no_grads = calibrate(model, chunks[:1], ["a"], CalibConfig(seq_len=T, max_tokens_per_file=T, gradients=False))
    assert no_grads.grad_sq_down is None
