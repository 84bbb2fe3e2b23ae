"""POST /v1/completions: prompts in (text, texts, token ids), completions out.

Choice i*n + j is prompt i's j-th sample, as in vLLM. With `echo` each choice's text
starts with its prompt. Streaming sends one chunk per delta; with
`stream_options.include_usage` a last chunk with `choices: []` and the usage. The chunks
of one wake-up (every choice's deltas since the last) go out as one write.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pagedweight.gateway.errors import APIError
from pagedweight.gateway.generation import ChoiceSpec
from pagedweight.gateway.logprobs import CompletionLogprobs, merge_completion
from pagedweight.gateway.protocol import (
    CompletionChoice, CompletionRequest, CompletionResponse, StreamResponse, UsageInfo,
)
from pagedweight.gateway.serving import (
    SSE_DONE, ServingBase, first_and_rest, session_headers, sse, stream_error, with_first,
)
from pagedweight.gateway.sessions import Session


class CompletionServing(ServingBase):
    async def prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        encode = self.state.sandbox.encode
        if isinstance(prompt, str):
            prompts = [await encode(prompt, "prompt")]
        elif prompt and isinstance(prompt[0], str):
            if sum(len(p) for p in prompt) > self.state.config.max_prompt_chars:
                raise APIError(413, f"the prompts are longer than {self.state.config.max_prompt_chars} "
                                    f"characters in all", "prompt")
            prompts = [await encode(p, "prompt") for p in prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if not prompts:
            raise APIError(400, "prompt is empty: give at least one token", "prompt")
        return [self.check_token_ids(p, "prompt") for p in prompts]

    async def create(self, request: CompletionRequest, request_id: str, session_id: str | None,
                     tenant: str = ""):
        self.check_common(request, {"suffix": request.suffix is not None})
        prompts = await self.prompts(request)
        stops = self.stop_strings(request.stop)
        specs = []
        for i, ids in enumerate(prompts):
            max_tokens = self.resolve_max_tokens(request.max_tokens, len(ids), "max_tokens")
            for j in range(request.n):
                specs.append(ChoiceSpec(i * request.n + j, ids,
                                        self.sampling(request, max_tokens, j, request.logprobs), stops))
        echoes = [self.codec.decode(p) if request.echo else "" for p in prompts]
        self.admit()
        try:
            session = await self.load_session(session_id, tenant)
            generation = self.route(request_id, session_id, session)
            first, rest = await first_and_rest(generation.stream(specs))
        except BaseException:
            self.release()
            raise
        response_id = f"cmpl-{request_id}"
        num_prompt_tokens = sum(len(p) for p in prompts)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            body = self._stream(request, response_id, with_first(first, rest), echoes, num_prompt_tokens,
                                include_usage, generation, session_id, session)
            return StreamingResponse(body, media_type="text/event-stream", headers=session_headers(session))
        try:
            texts, counts, reasons, stop_reasons = _collect_init(len(specs))
            logprobs = self._logprobs(request, echoes)
            parts = [[] for _ in specs]
            async for batch in with_first(first, rest):
                for delta in batch:
                    texts[delta.index] += delta.text
                    counts[delta.index] += delta.num_tokens
                    if logprobs is not None and delta.logprobs:
                        parts[delta.index].append(logprobs[delta.index].part(delta.logprobs))
                    if delta.finish_reason:
                        reasons[delta.index], stop_reasons[delta.index] = delta.finish_reason, delta.stop_reason
            await self._save_session(session_id, session, generation.address)
        finally:
            self.release()
        self.record(num_prompt_tokens, counts, reasons, generation.timer.arrival)
        choices = [CompletionChoice(index=k, text=echoes[k // request.n] + texts[k], finish_reason=reasons[k],
                                    stop_reason=stop_reasons[k],
                                    logprobs=merge_completion(parts[k]) if logprobs is not None else None)
                   for k in range(len(specs))]
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=sum(counts),
                          total_tokens=num_prompt_tokens + sum(counts))
        response = CompletionResponse(id=response_id, model=self.state.config.model_name, choices=choices,
                                      usage=usage, system_fingerprint=self.state.fingerprint)
        return JSONResponse(response.model_dump(), headers=session_headers(session))

    async def _stream(self, request, response_id, deltas: AsyncIterator, echoes, num_prompt_tokens,
                      include_usage, generation, session_id, session) -> AsyncIterator[str]:
        created, model = int(time.time()), self.state.config.model_name
        num_choices = len(echoes) * request.n
        counts, reasons = [0] * num_choices, ["abort"] * num_choices
        echoed = [False] * num_choices
        logprobs = self._logprobs(request, echoes)
        fingerprint = self.state.fingerprint
        try:
            async for batch in deltas:
                events = []
                for delta in batch:
                    k = delta.index
                    counts[k] += delta.num_tokens
                    text = delta.text
                    if not echoed[k]:
                        text, echoed[k] = echoes[k // request.n] + text, True
                    if not text and delta.finish_reason is None and not (logprobs and delta.logprobs):
                        continue
                    if delta.finish_reason:
                        reasons[k] = delta.finish_reason
                    part = logprobs[k].part(delta.logprobs) if logprobs is not None else None
                    choice = CompletionChoice(index=k, text=text, logprobs=part, finish_reason=delta.finish_reason,
                                              stop_reason=delta.stop_reason)
                    events.append(sse(StreamResponse(
                        id=response_id, object="text_completion", created=created, model=model,
                        choices=[choice], system_fingerprint=fingerprint)))
                if events:
                    yield "".join(events)
            if include_usage:
                usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=sum(counts),
                                  total_tokens=num_prompt_tokens + sum(counts))
                yield sse(StreamResponse(id=response_id, object="text_completion", created=created,
                                         model=model, choices=[], usage=usage, system_fingerprint=fingerprint))
            await self._save_session(session_id, session, generation.address)
            yield SSE_DONE
        except APIError as err:
            reasons = [r if r != "abort" else "error" for r in reasons]
            yield stream_error(err)
        finally:
            await deltas.aclose()
            self.release()
            self.record(num_prompt_tokens, counts, reasons, generation.timer.arrival)

    def _logprobs(self, request: CompletionRequest, echoes: list[str]) -> list[CompletionLogprobs] | None:
        """Each choice's logprobs accumulator (text offsets start after an echoed prompt)."""
        if request.logprobs is None:
            return None
        return [CompletionLogprobs(self.codec.decode, len(echoes[k // request.n]))
                for k in range(len(echoes) * request.n)]

    async def _save_session(self, session_id: str | None, session: Session | None, address: str) -> None:
        if session_id is not None:
            session.worker = address
            await self.save_session(session)


def _collect_init(num: int):
    return [""] * num, [0] * num, ["abort"] * num, [None] * num
