"""Graph replays against eager steps, for the GPU engine tests.

A replayed step's logits are compared with the same step run eagerly right after it (the eager
forward rewrites the same KV values, so the next step sees what it would have)."""

from __future__ import annotations

import torch


def compare_replays_with_eager(runner, model) -> list[tuple[int, int, float, float]]:
    """Wrap runner._replay so each replayed step is also run eagerly; returns the list it fills
    with (sequences, token rows, relative logit error, argmax agreement) per replayed step. The
    graph's own argmax (its sampled greedy tokens) must be its logits' argmax."""
    replay, checked = runner._replay, []

    def replay_and_compare(scheduled):
        replayed = replay(scheduled)
        if replayed is not None:
            logits, tokens = (t.clone() for t in replayed)
            assert torch.equal(tokens, logits.argmax(-1))
            ids, step, rows = runner.prepare(scheduled)
            eager = model.forward_paged(ids, step, rows).float()
            logits = logits.float()
            rel = ((logits - eager).norm() / eager.norm()).item()
            same = (logits.argmax(-1) == eager.argmax(-1)).float().mean().item()
            checked.append((len(scheduled), sum(s.num_new_tokens for s in scheduled), rel, same))
        return replayed

    runner._replay = replay_and_compare
    return checked
