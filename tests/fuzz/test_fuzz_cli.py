"""Fuzz the command line: a valid command of each kind with one to three of its flags
replaced by hostile values, dropped, or followed by junk (harness.py: the outcomes allowed).

Flags that size the work (--requests, --max-tokens, ...) take small hostile values only:
a huge --requests is a long benchmark the user asked for, not a hang."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import assert_clean_outcome, fuzz_settings, run_cli, tree_digest
from tests.fuzz.strategies import EDGE_TEXT

WORK_FLAGS = {"--requests", "--concurrency", "--prompt-len", "--max-tokens", "--seq-len", "--prompt-tokens",
              "--max-num-seqs", "--max-num-batched-tokens"}
SMALL_TEXT = ["-1", "0", "1", "2", "3", "", "x", "nan", "1.5", "\uff12", "-0", " 2"]


def commands(checkpoint, paged, text_dir, out) -> dict[str, list[str]]:
    """A valid, quick invocation of each sub-command."""
    text = str(text_dir / "valid.txt")
    return {
        "generate": ["generate", "--model", str(checkpoint), "--prompt", "And God said", "--max-tokens", "3",
                     "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--seed", "1", "--device", "cpu"],
        "eval": ["eval", "ppl", "--model", str(paged), "--bits", "4", "--text", text, "--seq-len", "8",
                 "--max-tokens", "8", "--dtype", "float32"],
        "plan": ["plan", "--model", str(paged), "--avg-bits", "4.5", "--policy", "pagedweight", "--out", str(out),
                 "--prompt-file", text, "--prompt-tokens", "16"],
        "bench": ["bench", "engine", "--model", str(paged), "--memory-budget", "20MiB", "--requests", "3",
                  "--concurrency", "2", "--prompt-len", "4", "--max-tokens", "2", "--policy", "pagedweight",
                  "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16", "--seed", "0"],
    }


def flag_positions(argv: list[str]) -> list[int]:
    return [i for i, a in enumerate(argv) if a.startswith("--") and i + 1 < len(argv)
            and not argv[i + 1].startswith("--")]


@st.composite
def mutated_argv(draw, base: list[str], paths: list[str], out_values: list[str]) -> list[str]:
    argv = list(base)
    for _ in range(draw(st.integers(1, 3))):
        positions = flag_positions(argv)
        if not positions:
            break
        i = draw(st.sampled_from(positions))
        op = draw(st.sampled_from(["value", "value", "value", "drop", "junk"]))
        if op == "drop":
            del argv[i:i + 2]
        elif op == "junk":  # (not after --out: that would make the junk the output path)
            at = draw(st.integers(1, len(argv)))
            if argv[at - 1] != "--out":
                argv.insert(at, draw(st.sampled_from(EDGE_TEXT + ["--bogus", "-x"])))
        elif argv[i] == "--out":  # hostile, but never a path outside the test's own folder
            argv[i + 1] = draw(st.sampled_from(out_values))
        else:
            small = argv[i] in WORK_FLAGS
            pool = SMALL_TEXT if small else EDGE_TEXT + paths
            argv[i + 1] = draw(st.one_of(st.sampled_from(pool), st.text(max_size=8)) if not small
                               else st.sampled_from(pool))
    return argv


@fuzz_settings(ci_examples=25)
@given(data=st.data())
def test_fuzz_command_line(tmp_path_factory, checkpoint_dir, paged_micro_dir, fuzz_text, data):
    out_dir = tmp_path_factory.mktemp("cli_out")
    out = out_dir / "plan.json"
    name = data.draw(st.sampled_from(["generate", "eval", "plan", "bench"]), label="command")
    paths = [str(fuzz_text / "latin1.txt"), str(fuzz_text / "empty.txt"), str(fuzz_text), str(checkpoint_dir),
             str(paged_micro_dir), str(out_dir / "missing")]
    out_values = [str(out), str(out_dir), str(out_dir / "a" / "b.json"), "", "/dev/null", str(fuzz_text / "x.json")]
    argv = data.draw(mutated_argv(commands(checkpoint_dir, paged_micro_dir, fuzz_text, out)[name], paths,
                                  out_values), label="argv")
    written = Path(argv[argv.index("--out") + 1]) if "--out" in argv[:-1] else None
    before = tree_digest(checkpoint_dir, paged_micro_dir, fuzz_text, skip=written)
    assert_clean_outcome(*run_cli(argv))
    assert tree_digest(checkpoint_dir, paged_micro_dir, fuzz_text, skip=written) == before
    if written is not None and written.parent == fuzz_text:
        written.unlink(missing_ok=True)  # the shared text folder stays as it was
