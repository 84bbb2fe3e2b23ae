"""A request as the engine tracks it: tokens, KV blocks, status, finish reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedweight.engine.sampler import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its KV was dropped)
    RUNNING = "running"  # holds KV blocks, gets tokens every step it is scheduled
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id (stop strings: the front end aborts)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the client aborted


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose keys/values are in the KV cache
    block_ids: list[int] = field(default_factory=list)  # the block table
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # seeded sampling survives preemption
    arrival_time: float = field(default_factory=time.monotonic)  # added to the engine
    first_scheduled_time: float | None = None  # first left WAITING (not reset by preemption)
    queue_time_reported: bool = False  # the first output carried queue_time_s
    # the prompt's routing as prefilled (engine/prompt_routing.py; None: not recorded)
    prompt_counts: np.ndarray | None = None  # float64 [L, E]: top-k selections of its prompt tokens
    num_prompt_tokens_routed: int = 0  # prompt tokens counted (a recompute after preemption is not)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
