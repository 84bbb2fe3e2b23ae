"""Worker flags that reach the engine: `pagedweight worker --enforce-eager` (vLLM's flag)
turns CUDA graphs off in the runtime the worker builds; with `--no-warm-up` the start-up
heap is still frozen out of the garbage collector."""

from __future__ import annotations

import gc

from pagedweight.cli.main import build_parser
from pagedweight.common.gc_pauses import unfreeze
from pagedweight.cli.worker_cmd import config_from_args
from pagedweight.worker.server import load_runtime


def _config(model_dir, *flags):
    args = build_parser().parse_args(["worker", "--model", str(model_dir), "--no-warm-up", *flags])
    return config_from_args(args)


def test_enforce_eager_reaches_the_engine(micro_paged):
    assert _config(micro_paged).enforce_eager is False
    config = _config(micro_paged, "--enforce-eager")
    assert config.enforce_eager is True
    unfreeze()
    runtime = load_runtime(config)
    try:
        assert runtime.engine.config.enforce_eager is True
        assert runtime.engine.runner.graphs is None
        assert gc.get_freeze_count() > 0  # frozen though the warm-up was skipped
    finally:
        runtime.close()
        unfreeze()



def test_prompt_residuals_are_opt_in(micro_paged, monkeypatch):
    """Off by default (docs/calibration.md: no measured gain held out); `--prompt-residuals`
    reaches the runtime's config, which then feeds the prompts through the artifact's heads."""
    import pagedweight.runtime

    seen = []
    monkeypatch.setattr(pagedweight.runtime, "build_runtime", lambda model_dir, config, progress=None:
                        seen.append(config.prompt_residuals) or object())
    for flags, on in (((), False), (("--prompt-residuals",), True)):
        config = _config(micro_paged, *flags)
        assert config.prompt_residuals is on
        load_runtime(config)
        unfreeze()
    assert seen == [False, True]
