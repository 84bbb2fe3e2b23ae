from dataclasses import dataclass, field

import pytest

from pagedweight.cli.config_defaults import default_of
from pagedweight.cli.main import build_parser
from pagedweight.engine.scheduler import SchedulerConfig


@dataclass
class Example:
    required: int
    plain: int = 3
    made: list = field(default_factory=lambda: [1, 2])


def test_plain_and_factory_defaults():
    assert default_of(Example, "plain") == 3
    assert default_of(Example, "made") == [1, 2]


def test_missing_default_and_unknown_field_are_errors():
    with pytest.raises(TypeError):
        default_of(Example, "required")
    with pytest.raises(AttributeError):
        default_of(Example, "nope")


def test_bench_engine_flags_follow_the_scheduler_config():
    args = build_parser().parse_args(["bench", "engine", "--model", "m", "--memory-budget", "1MiB"])
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (
        SchedulerConfig().max_num_seqs, SchedulerConfig().max_num_batched_tokens)
