"""`pagedweight serve --workers N`: each worker's ports and GPU, and the flags refused with
one error line and exit code 2. (The cluster itself: tests/e2e/test_serve_workers.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedweight.cli.main import build_parser
from pagedweight.cli.serve_cmd import plan_layout, service_argvs
from pagedweight.cluster.layout import WorkerSlot, visible_gpus, worker_env, worker_gpus
from pagedweight.common.errors import UserError
from service_procs import REPO


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--model", "models/micro-mixtral", *flags])


def test_visible_gpus_follow_cuda_visible_devices_entry_by_entry():
    assert visible_gpus(4, None) == ["0", "1", "2", "3"]
    assert visible_gpus(2, "3, 1") == ["3", "1"]
    assert visible_gpus(1, "GPU-5d2c,7") == ["GPU-5d2c"]  # CUDA stopped at the first it cannot use
    assert visible_gpus(0, "") == []


def test_one_gpu_per_worker_and_never_more_workers_than_gpus():
    assert worker_gpus(2, "cpu", None) == [None, None]
    assert worker_gpus(2, "cuda", ["3", "1", "0"]) == ["3", "1"]
    assert worker_gpus(1, "cuda:1", ["0", "1"]) == [None]  # one named GPU: the worker is given it as is
    with pytest.raises(UserError, match=r"^--workers 3: one worker per GPU, and 2 GPUs visible$"):
        worker_gpus(3, "cuda", ["0", "1"])
    with pytest.raises(UserError, match="no GPU is visible"):
        worker_gpus(1, "cuda", [])
    with pytest.raises(UserError, match="--device cuda:2: 2 GPUs visible"):
        worker_gpus(1, "cuda:2", ["0", "1"])
    with pytest.raises(UserError, match="use --device cuda$"):
        worker_gpus(2, "cuda:0", ["0", "1"])
    assert worker_env(WorkerSlot("worker-1", 1, 2, "GPU-5d2c")) == {"CUDA_VISIBLE_DEVICES": "GPU-5d2c"}
    assert worker_env(WorkerSlot("worker", 1, 2, None)) == {}


def test_one_worker_keeps_the_default_ports_and_n_workers_take_the_next_ones():
    slots, planner, planner_metrics = plan_layout(serve_args())
    assert [(s.name, s.port, s.metrics_port) for s in slots] == [("worker", 50051, 9091)]
    assert (planner, planner_metrics) == (50052, 9092)
    slots, planner, planner_metrics = plan_layout(serve_args("--workers", "3"))
    assert [(s.name, s.port, s.metrics_port, s.cuda_visible_devices) for s in slots] == [
        ("worker-0", 50051, 9091, None), ("worker-1", 50052, 9092, None), ("worker-2", 50053, 9093, None)]
    assert (planner, planner_metrics) == (50054, 9094)
    _, planner, planner_metrics = plan_layout(serve_args("--workers", "2", "--planner-port", "7000",
                                                         "--planner-metrics-port", "7001"))
    assert (planner, planner_metrics) == (7000, 7001)


def test_the_services_of_two_gpu_workers(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,2")
    args = serve_args("--workers", "2", "--device", "cuda", "--served-model-name", "micro")
    slots, planner, planner_metrics = plan_layout(args, num_visible_gpus=2)
    assert [s.cuda_visible_devices for s in slots] == ["6", "2"]
    argvs = service_argvs(args, tmp_path, slots, planner, planner_metrics)
    assert list(argvs) == ["planner", "worker-0", "worker-1", "gateway"]
    for slot in slots:
        argv = argvs[slot.name]
        # each sees its one GPU as cuda:0, has its own ports and registers with the one planner
        assert argv[argv.index("--device") + 1] == "cuda"
        assert argv[argv.index("--port") + 1] == str(slot.port)
        assert argv[argv.index("--http-port") + 1] == str(slot.metrics_port)
        assert argv[argv.index("--planner") + 1] == f"127.0.0.1:{planner}"
    gateway = argvs["gateway"]
    assert gateway[gateway.index("--workers") + 1] == "127.0.0.1:50051,127.0.0.1:50052"
    with pytest.raises(UserError, match="--workers 3: one worker per GPU, and 2 GPUs visible"):
        plan_layout(serve_args("--workers", "3", "--device", "cuda"), num_visible_gpus=2)


def test_ports_that_collide_are_refused():
    with pytest.raises(UserError, match=r"^--planner-port 50052 is also --worker-port \+ 1 \(worker-1\)"):
        plan_layout(serve_args("--workers", "2", "--planner-port", "50052"))
    with pytest.raises(UserError, match=r"^--port 9092 is also --worker-metrics-port \+ 1 \(worker-1\)"):
        plan_layout(serve_args("--workers", "2", "--port", "9092"))
    with pytest.raises(UserError, match="--worker-port 65535: 2 workers need ports up to 65536"):
        plan_layout(serve_args("--workers", "2", "--worker-port", "65535"))


@pytest.mark.parametrize("flags, message", [
    (("--workers", "0"), "argument --workers: must be >= 1, got 0"),
    (("--workers", "two"), "argument --workers: not a whole number: 'two'"),
    # CUDA_VISIBLE_DEVICES="" below: no GPU visible, on any machine
    (("--workers", "2", "--device", "cuda"), "--workers 2: one worker per GPU, and no GPU is visible"),
    (("--workers", "2", "--planner-port", "50052"), "--planner-port 50052 is also --worker-port + 1 (worker-1)"),
])
def test_bad_workers_flags_are_one_line_and_exit_2(flags, message):
    result = subprocess.run([sys.executable, "-m", "pagedweight.cli.main", "serve", "--model", "models/micro-mixtral",
                             *flags], capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert "serving" not in result.stdout
