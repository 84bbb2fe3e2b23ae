"""One entry point for the benchmarks: `python -m bench list` and `python -m bench run NAME`.

    python -m bench list                       # the recipes (bench/recipes.py), CPU and GPU
    python -m bench run planner-speed          # one recipe; the result lands in bench/results/
    python -m bench run real-shape-qwen --dry-run
    python -m bench run serve-load --artifacts /tmp/paged -- --request-rate 4
    python -m bench tables [--check]           # the docs' tables from bench/results/ (bench/tables.py)

Each recipe runs `python -m bench.<module> ARGS` in a child process with the import path
set (services/ and kernels/ from the repository root), so it also runs on a machine given
a copy of the tree and no virtual environment. The result JSON is stamped with date,
commit and GPU by bench/bench_meta.py; a tree that is no git checkout names its commit in
$PAGEDWEIGHT_COMMIT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.recipes import BY_NAME, RECIPES, Recipe

REPO = Path(__file__).resolve().parent.parent


def command(recipe: Recipe, artifacts: str, extra: list[str]) -> list[str]:
    args = [a.replace("{artifacts}", artifacts) for a in recipe.args]
    return [sys.executable, "-m", f"bench.{recipe.module}", *args, *extra]


def child_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(REPO), str(REPO / "services"), str(REPO / "kernels")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def full_depth_staging(cmd: list[str]) -> tuple[list[str], list[Path]]:
    """quantize-full-depth: the checkpoint (28.6 GB) is built first, in its own process so the
    quantiser's peak memory is its own, into /dev/shm with the work directory, since a
    64 GB device disk cannot hold checkpoint, work directory (~24 GB) and artifact (~23 GB).
    Returns the quantising command and the folders to remove after it."""
    shm = Path("/dev/shm/pagedweight-full-depth")
    shutil.rmtree(shm, ignore_errors=True)
    subprocess.run([*cmd, "--checkpoint", str(shm / "ckpt"), "--build-only"], cwd=REPO, env=child_env(), check=True)
    disk = Path(os.environ.get("TMPDIR", "/tmp")) / "pagedweight-full-depth"
    artifact = disk if shutil.disk_usage(disk.parent).free > 35e9 else shm / "art"
    run = [*cmd, "--checkpoint", str(shm / "ckpt"), "--work", str(artifact), "--work-dir", str(shm / "work")]
    return run, [shm, disk]


STAGING = {"quantize-full-depth": full_depth_staging}


def list_recipes() -> None:
    width = max(len(r.name) for r in RECIPES)
    for r in RECIPES:
        print(f"{r.name:<{width}}  {r.device}  {r.what}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("list", help="the recipes")
    run = sub.add_parser("run", help="run one recipe")
    run.add_argument("recipe", choices=sorted(BY_NAME))
    run.add_argument("--artifacts", default=os.environ.get("PAGEDWEIGHT_ARTIFACTS", "/work/artifacts/paged"),
                     help="folder of paged models, one per model name (pagedweight quantize writes them)")
    run.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    tables = sub.add_parser("tables", help="rewrite the docs' tables from bench/results/")
    tables.add_argument("--check", action="store_true", help="exit 1 where a page is stale; write nothing")
    args = parser.parse_args(own)
    if args.verb == "list":
        list_recipes()
        return 0
    if args.verb == "tables":
        from bench import tables as docs_tables

        return docs_tables.main(["--check"] if args.check else [])
    recipe = BY_NAME[args.recipe]
    cmd = command(recipe, args.artifacts, extra)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    staged: list[Path] = []
    if recipe.name in STAGING:
        cmd, staged = STAGING[recipe.name](cmd)
    try:
        return subprocess.run(cmd, cwd=REPO, env=child_env()).returncode
    finally:
        for path in staged:  # tens of GB, some of it in RAM (/dev/shm)
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
