"""Internal RPC that trusts no one: tokens, per-caller ownership, bounded and expiring
planner registrations, refusal of unauthenticated non-loopback ports. Real gRPC on
loopback: the planner service in this process, the worker as its own process."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pagedweight.common.errors import UserError
from pagedweight.common.metrics import PlannerServiceMetrics
from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.planner_service.server import PlannerServicer
from pagedweight.rpc import planner_pb2, planner_pb2_grpc, worker_pb2, worker_pb2_grpc
from service_procs import REPO, free_port
from tests.e2e.cluster import Service, wait_until
from tests.planner_service.test_planner_service import register_request, registration

TOKEN_A, TOKEN_B = "a" * 20 + "-token-of-gateway", "b" * 20 + "-token-of-intruder"


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "rpc-tokens"
    path.write_text(f"# callers\ngateway:{TOKEN_A}\nintruder:{TOKEN_B}\n")
    return path


def auth(token):
    return (("authorization", f"Bearer {token}"),)


def serve_planner(security, body, **limits):
    async def main():
        port = free_port()
        server = grpc.aio.server(interceptors=security.interceptors())
        servicer = PlannerServicer(PlannerServiceMetrics(CollectorRegistry()), security, **limits)
        planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)
        security.add_port(server, "127.0.0.1", port)
        await server.start()
        try:
            return await asyncio.to_thread(body, planner_pb2_grpc.PlannerStub(
                grpc.insecure_channel(f"127.0.0.1:{port}")))
        finally:
            await server.stop(None)

    return asyncio.run(main())


def test_planner_refuses_calls_without_a_valid_token(token_file):
    security = RpcSecurity.from_settings(str(token_file))

    def body(stub):
        request = register_request("w1", registration())
        for metadata in ((), auth("x" * 20), (("authorization", TOKEN_A),)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Register(request, metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Register(request, metadata=auth(TOKEN_A), timeout=10).registration_id

    serve_planner(security, body)


def test_a_worker_id_belongs_to_the_caller_that_registered_it(token_file):
    security = RpcSecurity.from_settings(str(token_file))

    def body(stub):
        reply = stub.Register(register_request("w1", registration()), metadata=auth(TOKEN_A), timeout=10)
        with pytest.raises(grpc.RpcError) as taken:  # the intruder cannot replace it ...
            stub.Register(register_request("w1", registration()), metadata=auth(TOKEN_B), timeout=10)
        assert taken.value.code() == grpc.StatusCode.PERMISSION_DENIED
        plan = planner_pb2.PlanRequest(worker_id="w1", registration_id=reply.registration_id)
        with pytest.raises(grpc.RpcError) as hidden:  # ... nor receive its plans, even knowing its ids
            stub.Plan(plan, metadata=auth(TOKEN_B), timeout=10)
        assert hidden.value.code() == grpc.StatusCode.NOT_FOUND

    serve_planner(security, body)


def test_registrations_are_bounded_and_expire_without_calls():
    security = RpcSecurity(tokens={TOKEN_A: "workers"})  # one caller: the whole cap is its share

    def body(stub):
        for i in range(2):
            stub.Register(register_request(f"w{i}", registration()), metadata=auth(TOKEN_A), timeout=10)
        with pytest.raises(grpc.RpcError) as full:
            stub.Register(register_request("w2", registration()), metadata=auth(TOKEN_A), timeout=10)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        time.sleep(1.2)  # no call from w0, w1: both expire, room again
        reply = stub.Register(register_request("w2", registration()), metadata=auth(TOKEN_A), timeout=10)
        assert reply.registration_id

    serve_planner(security, body, max_workers=2, registration_ttl_s=1.0)


def test_one_caller_cannot_fill_the_planners_registrations(token_file):
    security = RpcSecurity.from_settings(str(token_file))  # two callers: two registrations each

    def body(stub):
        for i in range(2):
            stub.Register(register_request(f"a{i}", registration()), metadata=auth(TOKEN_B), timeout=10)
        with pytest.raises(grpc.RpcError) as full:
            stub.Register(register_request("a2", registration()), metadata=auth(TOKEN_B), timeout=10)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "share" in full.value.details()
        # re-registering one it holds is no new registration
        assert stub.Register(register_request("a0", registration()), metadata=auth(TOKEN_B), timeout=10)
        for i in range(2):  # the other caller still has its share
            assert stub.Register(register_request(f"w{i}", registration()), metadata=auth(TOKEN_A),
                                 timeout=10).registration_id

    serve_planner(security, body, max_workers=4)


def test_an_open_port_off_loopback_is_refused_unless_asked_for():
    async def main():
        server = grpc.aio.server()
        with pytest.raises(UserError, match="--insecure-rpc"):
            RpcSecurity().add_port(server, "0.0.0.0", free_port())
        assert RpcSecurity(tokens={TOKEN_A: "a"}).add_port(server, "0.0.0.0", free_port()) > 0
        assert RpcSecurity(insecure=True).add_port(server, "0.0.0.0", free_port()) > 0
        await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("text", ["short", "name:short", "bad name:" + "t" * 20, "n:" + "t" * 15 + "\u00e9"])
def test_bad_token_files_are_one_clear_error(tmp_path, text):
    path = tmp_path / "tokens"
    path.write_text(text + "\n")
    with pytest.raises(UserError):
        RpcSecurity.from_settings(str(path))


def test_worker_checks_tokens_and_aborts_only_its_callers_requests(paged_micro_dir, token_file, tmp_path):
    port = free_port()
    worker = Service("worker", ["-m", "pagedweight.cli.main", "worker", "--model", str(paged_micro_dir),
                                "--port", str(port), "--memory-budget", "64MiB",
                                "--rpc-token-file", str(token_file)], tmp_path)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        wait_until(lambda: stub.GetStats(worker_pb2.GetStatsRequest(), metadata=auth(TOKEN_A), timeout=2).ready,
                   worker)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        sampling = worker_pb2.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0)
        request = worker_pb2.GenerateRequest(request_id="owned-1", prompt_token_ids=[1, 2, 3], sampling=sampling)
        stream = stub.Generate(request, metadata=auth(TOKEN_A), timeout=60)
        received = []
        reader = threading.Thread(target=lambda: received.extend(stream))
        reader.start()
        wait_until(lambda: received, worker, timeout_s=30, what="streaming")
        # ids are the caller's own: another caller may use the same one, and learns nothing
        short = worker_pb2.GenerateRequest(request_id="owned-1", prompt_token_ids=[1, 2, 3],
                                           sampling=worker_pb2.SamplingParams(max_tokens=2, ignore_eos=True))
        theirs = list(stub.Generate(short, metadata=auth(TOKEN_B), timeout=30))
        assert theirs[-1].finished and {m.request_id for m in theirs} == {"owned-1"}
        with pytest.raises(grpc.RpcError) as taken:  # the owner's own id is still taken for the owner
            list(stub.Generate(short, metadata=auth(TOKEN_A), timeout=30))
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert not stub.Abort(worker_pb2.AbortRequest(request_id="owned-1"), metadata=auth(TOKEN_B), timeout=5).found
        assert stub.Abort(worker_pb2.AbortRequest(request_id="owned-1"), metadata=auth(TOKEN_A), timeout=5).found
        reader.join(30)
        assert received[-1].finished and received[-1].finish_reason == "abort"
    finally:
        channel.close()
        worker.stop()


def test_generate_stream_needs_the_token_and_aborts_only_its_callers_requests(paged_micro_dir, token_file,
                                                                            tmp_path):
    port = free_port()
    worker = Service("worker", ["-m", "pagedweight.cli.main", "worker", "--model", str(paged_micro_dir),
                                "--port", str(port), "--memory-budget", "64MiB",
                                "--rpc-token-file", str(token_file)], tmp_path)
    address = f"127.0.0.1:{port}"
    sampling = worker_pb2.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0)

    def generate(request_id):
        return worker_pb2.StreamRequest(generate=worker_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=sampling))

    def abort(request_id):
        return worker_pb2.StreamRequest(abort=worker_pb2.AbortRequest(request_id=request_id))

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            anonymous = stub.GenerateStream()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anonymous.write(generate("anonymous-1"))
                await anonymous.read()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            owner = stub.GenerateStream(metadata=auth(TOKEN_A))
            await owner.write(generate("streamed-1"))
            assert (await owner.read()).outputs[0].request_id == "streamed-1"
            intruder = stub.GenerateStream(metadata=auth(TOKEN_B))
            await intruder.write(abort("streamed-1"))  # not its request: ignored
            await intruder.done_writing()
            assert [m async for m in intruder] == []
            other = stub.GenerateStream(metadata=auth(TOKEN_B))  # the same id, its own request
            await other.write(worker_pb2.StreamRequest(generate=worker_pb2.GenerateRequest(
                request_id="streamed-1", prompt_token_ids=[1, 2, 3],
                sampling=worker_pb2.SamplingParams(max_tokens=2, ignore_eos=True))))
            await other.done_writing()
            replies = [m async for m in other]
            assert not any(m.errors for m in replies)
            outputs = [o for m in replies for o in m.outputs]
            assert {o.request_id for o in outputs} == {"streamed-1"} and outputs[-1].finished
            found = await stub.Abort(worker_pb2.AbortRequest(request_id="streamed-1"), metadata=auth(TOKEN_B))
            assert not found.found
            running = await owner.read()
            assert running.outputs and not any(o.finished for o in running.outputs)
            await owner.write(abort("streamed-1"))
            while True:
                finals = [o for o in (await owner.read()).outputs if o.finished]
                if finals:
                    assert finals[0].finish_reason == "abort"
                    break
            await owner.done_writing()

    sync_channel = grpc.insecure_channel(address)
    try:
        stub = worker_pb2_grpc.WorkerStub(sync_channel)
        wait_until(lambda: stub.GetStats(worker_pb2.GetStatsRequest(), metadata=auth(TOKEN_A), timeout=2).ready,
                   worker)
        asyncio.run(main())
    finally:
        sync_channel.close()
        worker.stop()


def test_a_worker_on_a_public_interface_without_a_token_does_not_start(paged_micro_dir):
    result = subprocess.run([sys.executable, "-m", "pagedweight.cli.main", "worker", "--model",
                             str(paged_micro_dir), "--host", "0.0.0.0", "--port", str(free_port())],
                            capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={"PYTHONPATH": f"{REPO}/services:{REPO}/kernels", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--insecure-rpc" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certificates(tmp_path):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=test-ca", cwd=tmp_path)
    for name, san in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "subjectAltName=DNS:client")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=tmp_path)
        (tmp_path / f"{name}.ext").write_text(san + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext", cwd=tmp_path)
    return tmp_path


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(certificates, token_file):
    c = certificates
    server_side = RpcSecurity.from_settings(str(token_file), ca=str(c / "ca.crt"), cert=str(c / "server.crt"),
                                            key=str(c / "server.key"))
    client_side = RpcSecurity.from_settings(str(token_file), ca=str(c / "ca.crt"), cert=str(c / "client.crt"),
                                            key=str(c / "client.key"))
    no_client_cert = RpcSecurity.from_settings(str(token_file), ca=str(c / "ca.crt"))

    async def main():
        port = free_port()
        server = grpc.aio.server(interceptors=server_side.interceptors())
        servicer = PlannerServicer(PlannerServiceMetrics(CollectorRegistry()), server_side)
        planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)
        assert server_side.add_port(server, "0.0.0.0", port) > 0  # TLS: a public interface is allowed
        await server.start()
        try:
            request = register_request("w1", registration())
            async with client_side.channel(f"127.0.0.1:{port}") as channel:
                reply = await planner_pb2_grpc.PlannerStub(channel).Register(
                    request, metadata=client_side.metadata(), timeout=10)
                assert reply.registration_id
            async with no_client_cert.channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await planner_pb2_grpc.PlannerStub(channel).Register(
                        request, metadata=no_client_cert.metadata(), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext to a TLS port
                with pytest.raises(grpc.aio.AioRpcError):
                    await planner_pb2_grpc.PlannerStub(channel).Register(request, metadata=AUTH_A, timeout=10)
        finally:
            await server.stop(None)

    asyncio.run(main())


AUTH_A = (("authorization", f"Bearer {TOKEN_A}"),)


def test_a_worker_registers_with_a_token_protected_planner(paged_micro_dir, token_file, tmp_path):
    planner_port, worker_port = free_port(), free_port()
    planner = Service("planner", ["-m", "pagedweight.cli.main", "planner", "--port", str(planner_port),
                                  "--rpc-token-file", str(token_file)], tmp_path)
    worker = Service("worker", ["-m", "pagedweight.cli.main", "worker", "--model", str(paged_micro_dir),
                                "--port", str(worker_port), "--memory-budget", "64MiB",
                                "--planner", f"127.0.0.1:{planner_port}", "--rpc-token-file", str(token_file)],
                     tmp_path)
    try:
        wait_until(lambda: "registered" in planner.log_path.read_text(), planner, timeout_s=120,
                   what="registered by the worker")
        assert "worker 127.0.0.1:%d registered" % worker_port in planner.log_path.read_text()
        assert "UNAUTHENTICATED" not in worker.log_path.read_text()
    finally:
        worker.stop()
        planner.stop()
