"""Generate the Python gRPC stubs of proto/pagedweight/v1/*.proto into pagedweight.rpc.

    python proto/generate.py          # (re)write services/pagedweight/rpc/*_pb2*.py(i)
    python proto/generate.py --check  # exit 1 if the committed stubs differ from a fresh run

The stubs are build output, never edited by hand. protoc names Python modules after the
proto package (`pagedweight.v1`); we keep them in `pagedweight.rpc` instead, so the one
import line protoc writes in each *_pb2_grpc.py is rewritten to match. grpcio-tools is
pinned in the test extras: another version writes other version guards, which --check
would (rightly) report as stale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "services" / "pagedweight" / "rpc"
PROTOC_PACKAGE = "pagedweight.v1"  # where protoc thinks the modules live
PYTHON_PACKAGE = "pagedweight.rpc"  # where they do


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "pagedweight" / "v1").glob("*.proto"))


def generate() -> dict[str, str]:
    """file name -> contents of every generated stub."""
    from grpc_tools import protoc  # dev-only dependency, imported when generating

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}"] + [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out = {}
        for path in sorted((Path(tmp) / "pagedweight" / "v1").iterdir()):
            text = path.read_text().replace(f"from {PROTOC_PACKAGE} import", f"from {PYTHON_PACKAGE} import")
            out[path.name] = text
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args(argv)
    fresh = generate()
    committed = {p.name: p.read_text() for p in OUT_DIR.glob("*_pb2*")}
    if args.check:
        stale = sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))
        if stale:
            print(f"stale gRPC stubs in {OUT_DIR.relative_to(ROOT)}: {', '.join(stale)}; "
                  "run `make proto`", file=sys.stderr)
            return 1
        return 0
    for name in committed.keys() - fresh.keys():
        (OUT_DIR / name).unlink()
    for name, text in fresh.items():
        (OUT_DIR / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
