"""POST /v1/chat/completions: messages in, an assistant message out.

The chat template comes from the model's tokenizer config. With a session, the stored
conversation goes before the messages sent (unless the client re-sent it whole), and the
reply of choice 0 is appended to it, so a client may send only its new message. A reply
that did not end normally (cut by a drain or an abort) is stored with its
`finish_reason`, so the session says it is incomplete.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pagedweight.gateway.errors import APIError
from pagedweight.gateway.generation import ChoiceSpec
from pagedweight.gateway.logprobs import chat_content
from pagedweight.gateway.protocol import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, StreamResponse,
    ChatMessage, ChatResponseMessage, ChatStreamChoice, DeltaMessage, UsageInfo,
)
from pagedweight.gateway.serving import (
    SSE_DONE, ServingBase, first_and_rest, session_headers, sse, stream_error, with_first,
)
from pagedweight.gateway.sessions import Session


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> {"role", "content"} with text content (parts joined)."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, "
                                        f"got type {part.get('type')!r}", f"messages.{i}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append({"role": message.role, "content": content or ""})
    return out


def conversation(stored: list[dict], sent: list[dict]) -> list[dict]:
    """The session's turns, then the new ones; a client that re-sends the whole
    conversation (it starts with the stored turns) is taken as it is."""
    turns = [{"role": m["role"], "content": m["content"]} for m in stored]  # without finish_reason
    if turns and sent[:len(turns)] != turns:
        return turns + sent
    return sent


class ChatServing(ServingBase):
    async def create(self, request: ChatCompletionRequest, request_id: str, session_id: str | None,
                     tenant: str = ""):
        self.check_common(request, {})
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        num_top = request.top_logprobs or 0
        logprobs = num_top if request.logprobs else None
        if not request.messages:
            raise APIError(400, "messages is empty: give at least one message", "messages")
        sent = message_dicts(request.messages)
        stops = self.stop_strings(request.stop)
        requested = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        self.admit()
        try:
            session = await self.load_session(session_id, tenant)
            messages = conversation(session.messages if session else [], sent)
            ids = self.check_token_ids(await self.state.sandbox.chat(messages, request.add_generation_prompt),
                                       "messages")
            max_tokens = self.resolve_max_tokens(requested, len(ids), param)
            specs = [ChoiceSpec(j, ids, self.sampling(request, max_tokens, j, logprobs), stops)
                     for j in range(request.n)]
            generation = self.route(request_id, session_id, session)
            first, rest = await first_and_rest(generation.stream(specs))
        except BaseException:
            self.release()
            raise
        echo = ""
        if request.echo and messages and messages[-1]["role"] == "assistant":
            echo = messages[-1]["content"]
        turn = _Turn(request_id, session_id, session, messages, generation, len(ids), request.n)
        turn.logprobs = [[] for _ in range(request.n)] if logprobs is not None else None
        turn.num_top, turn.decode = num_top, self.codec.decode
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(self._stream(turn, with_first(first, rest), echo, include_usage),
                                     media_type="text/event-stream", headers=session_headers(session))
        try:
            async for batch in with_first(first, rest):
                for delta in batch:
                    turn.add(delta)
            await self._save(turn)
        finally:
            self.release()
        self.record(turn.num_prompt_tokens, turn.counts, turn.reasons, generation.timer.arrival)
        choices = [ChatChoice(index=k, message=ChatResponseMessage(content=echo + turn.texts[k]),
                              finish_reason=turn.reasons[k], stop_reason=turn.stop_reasons[k],
                              logprobs={"content": turn.logprobs[k]} if turn.logprobs is not None else None)
                   for k in range(request.n)]
        response = ChatCompletionResponse(id=turn.response_id, model=self.state.config.model_name,
                                          choices=choices, usage=turn.usage(),
                                          system_fingerprint=self.state.fingerprint)
        return JSONResponse(response.model_dump(), headers=session_headers(turn.session))

    async def _stream(self, turn: "_Turn", deltas: AsyncIterator, echo: str,
                      include_usage: bool) -> AsyncIterator[str]:
        created, model = int(time.time()), self.state.config.model_name
        fingerprint = self.state.fingerprint

        def chunk(choices, usage=None):
            body = StreamResponse(id=turn.response_id, object="chat.completion.chunk", created=created,
                                  model=model, choices=choices, system_fingerprint=fingerprint)
            if usage is not None:
                body.usage = usage
            return sse(body)
        try:
            # vLLM's first chunk per choice: the role, with empty content (or the echo)
            yield chunk([ChatStreamChoice(index=k, delta=DeltaMessage(role="assistant", content=echo),
                                          logprobs=None, finish_reason=None) for k in range(turn.n)])
            async for batch in deltas:
                events = []
                for delta in batch:
                    new_logprobs = turn.add(delta)
                    if not delta.text and delta.finish_reason is None and not new_logprobs:
                        continue
                    events.append(chunk([ChatStreamChoice(
                        index=delta.index, delta=DeltaMessage(content=delta.text),
                        logprobs={"content": new_logprobs} if turn.logprobs is not None else None,
                        finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)]))
                if events:
                    yield "".join(events)
            if include_usage:
                yield chunk([], turn.usage())
            await self._save(turn)
            yield SSE_DONE
        except APIError as err:
            turn.reasons = [r if r != "abort" else "error" for r in turn.reasons]
            yield stream_error(err)
        finally:
            await deltas.aclose()
            self.release()
            self.record(turn.num_prompt_tokens, turn.counts, turn.reasons, turn.generation.timer.arrival)

    async def _save(self, turn: "_Turn") -> None:
        if turn.session_id is None:
            return
        session = turn.session
        session.worker = turn.generation.address
        reply = {"role": "assistant", "content": turn.texts[0]}
        if turn.reasons[0] not in ("stop", "length"):  # cut short: say so in the stored history
            reply["finish_reason"] = turn.reasons[0]
        session.messages = turn.messages + [reply]
        await self.save_session(session)


class _Turn:
    """One chat request's accumulating answer."""

    def __init__(self, request_id, session_id, session: Session | None, messages, generation,
                 num_prompt_tokens: int, n: int):
        self.response_id = f"chatcmpl-{request_id}"
        self.session_id, self.session, self.messages = session_id, session, messages
        self.generation, self.num_prompt_tokens, self.n = generation, num_prompt_tokens, n
        self.texts, self.counts = [""] * n, [0] * n
        self.reasons: list[str] = ["abort"] * n
        self.stop_reasons: list[str | None] = [None] * n
        self.logprobs: list[list[dict]] | None = None  # per choice, with the request's logprobs
        self.num_top, self.decode = 0, None

    def add(self, delta) -> list[dict]:
        """Takes a delta; returns its logprobs entries (empty without logprobs)."""
        self.texts[delta.index] += delta.text
        self.counts[delta.index] += delta.num_tokens
        if delta.finish_reason:
            self.reasons[delta.index], self.stop_reasons[delta.index] = delta.finish_reason, delta.stop_reason
        if self.logprobs is None or not delta.logprobs:
            return []
        entries = chat_content(self.decode, delta.logprobs, self.num_top)
        self.logprobs[delta.index].extend(entries)
        return entries

    def usage(self) -> UsageInfo:
        total = sum(self.counts)
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=total,
                         total_tokens=self.num_prompt_tokens + total)
