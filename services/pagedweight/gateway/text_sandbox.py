"""Chat templates and tokenisation of client text, in processes of their own.

A chat template is code from the model directory and the tokenizer is native code run on
client text: a template with nested loops never returns, a crafted prompt can drive a
tokenizer's regular expression into a panic or the process into an abort. None of that
may reach the event loop or the gateway process. So each job (render + encode, encode, or decode)
runs in one of `num_procs` spawned processes, each with its own tokenizer:

- a job that runs past `timeout_s` has its process killed and replaced: the client gets
  400 naming the limit, everyone else is served by the other processes meanwhile;
- a process that dies (abort, segfault, OOM kill) is replaced: the client gets 400;
- a panic in the tokenizer (a Python exception from pyo3) is a 400 as well;
- rendered text and prompts are bounded by `max_chars` (413) before tokenisation;
- each process's heap is bounded by `MAX_PROCESS_DATA_BYTES` (RLIMIT_DATA), so a template
  that builds a huge string fails with a MemoryError in its own process (a 400) instead of
  taking gigabytes from the host.

Jobs wait for a free process (an asyncio queue of them), so at most `num_procs` run at
once and a slow job never holds a thread of the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import resource
import time
from concurrent.futures import ThreadPoolExecutor

from pagedweight.gateway.errors import APIError

log = logging.getLogger("pagedweight.gateway.text_sandbox")

# Room for the tokenizer, its vocabulary and any prompt up to --max-prompt-chars, far below
# what one bad template could otherwise allocate.
MAX_PROCESS_DATA_BYTES = 1 << 30


def _child(model_dir: str, max_chars: int, conn) -> None:
    """A sandbox process: jobs in, ("ok", ids) / ("user", message) / ("error", message) out."""
    from pagedweight.common.errors import UserError
    from pagedweight.frontend.chat_template import OutputTooLong
    from pagedweight.frontend.tokenizer import Tokenizer

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = MAX_PROCESS_DATA_BYTES if hard == resource.RLIM_INFINITY else min(hard, MAX_PROCESS_DATA_BYTES)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    tokenizer = Tokenizer(model_dir)
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        kind = job[0]
        try:
            if kind == "chat":
                text = tokenizer.apply_chat_template(job[1], add_generation_prompt=job[2], max_chars=max_chars)
                conn.send(("ok", tokenizer.encode(text)))
            elif kind == "decode":
                conn.send(("ok", tokenizer.decode(job[1])))
            else:
                conn.send(("ok", tokenizer.encode(job[1])))
        except OutputTooLong as err:
            conn.send(("too_long", str(err)))
        except UserError as err:
            conn.send(("user", str(err)))
        except MemoryError:
            conn.send(("user", f"the chat template or tokenizer needed more than "
                               f"{MAX_PROCESS_DATA_BYTES >> 20} MiB on this input"))
        except BaseException as err:  # pyo3's PanicException derives from BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            conn.send(("user", f"the tokenizer failed on this text ({type(err).__name__})"))


class _Proc:
    def __init__(self, ctx, model_dir: str, max_chars: int):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(model_dir, max_chars, child_conn), daemon=True,
                                   name="pagedweight-text")
        self.process.start()
        child_conn.close()

    def wait_ready(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"a text process did not start within {timeout_s:g} s")
        self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class TextSandbox:
    def __init__(self, model_dir: str, num_procs: int, timeout_s: float, max_chars: int):
        self.model_dir, self.num_procs = str(model_dir), num_procs
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self._ctx = multiprocessing.get_context("spawn")  # no copy of the gateway's threads or loop
        self._idle: asyncio.Queue[_Proc] | None = None
        self._threads = ThreadPoolExecutor(num_procs, thread_name_prefix="pagedweight-text")
        self.num_restarts = 0

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        procs = [_Proc(self._ctx, self.model_dir, self.max_chars) for _ in range(self.num_procs)]
        for proc in procs:
            await asyncio.to_thread(proc.wait_ready, 120.0)
            self._idle.put_nowait(proc)

    async def close(self) -> None:
        if self._idle is None:
            return
        while not self._idle.empty():
            self._idle.get_nowait().kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def encode(self, text: str, param: str) -> list[int]:
        if len(text) > self.max_chars:
            raise APIError(413, f"{param} is longer than {self.max_chars} characters", param)
        return await self._run(("encode", text), param)

    async def decode(self, ids: list[int]) -> str:
        """The text of `ids` (checked against the vocabulary by the caller)."""
        return await self._run(("decode", ids), "tokens")

    async def chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The chat template rendered over the messages, tokenised."""
        size = sum(len(m.get("content") or "") + len(m.get("role") or "") for m in messages)
        if size > self.max_chars:
            raise APIError(413, f"messages are longer than {self.max_chars} characters", "messages")
        return await self._run(("chat", messages, add_generation_prompt), "messages")

    async def _run(self, job: tuple, param: str) -> list[int]:
        proc = await self._idle.get()
        loop = asyncio.get_running_loop()
        # The slot comes back when the job's thread ends, not when the caller stops waiting:
        # a client that disconnects mid-job must not hand a busy process to the next job.
        done = self._threads.submit(self._call, proc, job)
        done.add_done_callback(lambda _: loop.call_soon_threadsafe(self._idle.put_nowait, proc))
        status, value = await asyncio.wrap_future(done)
        if status == "ok":
            return value
        if status == "too_long":
            raise APIError(413, value, param)
        raise APIError(400, value, param)

    def _call(self, proc: _Proc, job: tuple):
        """Runs in a thread: one job on one process; on a time-out or death the process
        is replaced in place (the slot object stays, its process and pipe are new)."""
        started = time.monotonic()
        try:
            proc.conn.send(job)
            if proc.conn.poll(self.timeout_s):
                return proc.conn.recv()
            why = (f"the chat template or tokenizer did not finish within {self.timeout_s:g} s "
                   f"(--template-timeout)")
        except (EOFError, OSError, BrokenPipeError):
            why = "the chat template or tokenizer could not process this input (its process died)"
        log.warning("text job %s: %s after %.1f s; replacing its process", job[0], why, time.monotonic() - started)
        fresh = self._replace(proc, why)
        proc.__dict__.update(fresh.__dict__)  # the slot now holds the fresh process
        return ("user", why)

    def _replace(self, proc: _Proc, why: str) -> _Proc:
        proc.kill()
        self.num_restarts += 1
        fresh = _Proc(self._ctx, self.model_dir, self.max_chars)
        fresh.wait_ready(120.0)
        return fresh
