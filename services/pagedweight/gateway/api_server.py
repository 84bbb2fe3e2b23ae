"""The gateway's FastAPI app: routes of a few lines each, wiring in one lifespan.

    POST /v1/completions, /v1/chat/completions   -> serving_completions, serving_chat
    GET  /v1/models, /v1/models/{id}, /health, /metrics, /version
    POST /tokenize, /detokenize
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from importlib import metadata

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CollectorRegistry

from pagedweight.common.metrics import exposition
from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.gateway.config import GatewayConfig
from pagedweight.gateway.errors import (
    APIError, api_error_handler, error_response, http_error_handler, validation_error_handler,
)
from pagedweight.gateway.metrics import GatewayMetrics
from pagedweight.gateway.middleware import MAX_ID_CHARS, GatewayMiddleware, valid_id
from pagedweight.gateway.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse,
)
from pagedweight.gateway.serving import GatewayState
from pagedweight.gateway.serving_chat import ChatServing, message_dicts
from pagedweight.gateway.serving_completions import CompletionServing
from pagedweight.gateway.sessions import open_session_store
from pagedweight.gateway.tenants import Tenants
from pagedweight.gateway.text import TextCodec
from pagedweight.gateway.text_sandbox import TextSandbox
from pagedweight.gateway.workers import WorkerPool

log = logging.getLogger("pagedweight.gateway")
router = APIRouter()


def _state(raw: Request) -> GatewayState:
    return raw.app.state.gateway


def _session_id(raw: Request, body_session_id: str | None) -> str | None:
    """The client's session id. The header was checked by the middleware; the body's form
    is checked the same way."""
    session_id = raw.headers.get("x-session-id") or body_session_id or None
    if session_id is None:
        return None
    if not valid_id(session_id):
        raise APIError(400, f"session_id: must be 1 to {MAX_ID_CHARS} visible ASCII characters", "session_id")
    return session_id


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw: Request):
    serving = raw.app.state.completions
    return await serving.create(request, raw.state.request_id, _session_id(raw, request.session_id),
                                raw.state.tenant)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw: Request):
    serving = raw.app.state.chat
    return await serving.create(request, raw.state.request_id, _session_id(raw, request.session_id),
                                raw.state.tenant)


def _model_card(state: GatewayState) -> ModelCard:
    name = state.config.model_name
    return ModelCard(id=name, root=name, max_model_len=state.codec.max_model_len)


@router.get("/v1/models")
async def show_models(raw: Request) -> ModelList:
    return ModelList(data=[_model_card(_state(raw))])


@router.get("/v1/models/{model_id:path}")
async def show_model(model_id: str, raw: Request) -> ModelCard:
    state = _state(raw)
    if model_id != state.config.model_name:
        raise APIError(404, f"The model `{model_id}` does not exist.", "model")
    return _model_card(state)


@router.get("/health")
async def health(raw: Request):
    """503 while no worker is ready; else 200, with "degraded" while the session store is away
    (requests without a session are served; those with one get 503 until it is back)."""
    state = _state(raw)
    ready = state.pool.ready()
    if not ready:
        return error_response(503, "no worker is ready" + _starting(state))
    sessions_ok = await state.sessions.check()
    return JSONResponse({"status": "ok" if sessions_ok else "degraded",
                         "workers_ready": len(ready), "workers": len(state.pool.workers),
                         "session_store": state.sessions.backend if sessions_ok else "unavailable"})


def _starting(state: GatewayState) -> str:
    """The start-up progress of workers still loading (from their last GetStats)."""
    parts = []
    for address, worker in state.pool.workers.items():
        if worker.stats is not None and worker.stats.HasField("startup"):
            p = worker.stats.startup
            eta = f", about {p.eta_s:.0f} s to go" if p.HasField("eta_s") else ""
            parts.append(f"{address} starting: {p.phase}, {p.percent:.0f}% after {p.elapsed_s:.0f} s{eta}")
    return f" ({'; '.join(parts)})" if parts else ""


@router.get("/metrics")
async def metrics(raw: Request):
    state = _state(raw)
    state.metrics.workers_ready.set(len(state.pool.ready()))
    state.metrics.observe_workers({address: worker.stats for address, worker in state.pool.workers.items()})
    for backend in ("redis", "memory"):
        state.metrics.session_store.labels(backend=backend).set(int(state.sessions.backend == backend))
    body, content_type = exposition(raw.app.state.registry)
    return Response(body, media_type=content_type)


@router.get("/version")
async def version():
    return {"version": metadata.version("pagedweight")}


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw: Request) -> TokenizeResponse:
    state = _state(raw)
    if request.model is not None and request.model != state.config.model_name:
        raise APIError(404, f"The model `{request.model}` does not exist.", "model")
    if (request.prompt is None) == (request.messages is None):
        raise APIError(400, "give either prompt or messages", "prompt")
    if request.messages is not None:
        ids = await state.sandbox.chat(message_dicts(request.messages), request.add_generation_prompt)
    else:
        ids = await state.sandbox.encode(request.prompt, "prompt")
    return TokenizeResponse(count=len(ids), max_model_len=state.codec.max_model_len, tokens=ids)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    state = _state(raw)
    if request.model is not None and request.model != state.config.model_name:
        raise APIError(404, f"The model `{request.model}` does not exist.", "model")
    # no sequence the model serves is longer than its context; decoding runs in a text
    # process, so a long list never holds up the event loop
    limit = min(state.config.max_prompt_chars, state.codec.max_model_len)
    if len(request.tokens) > limit:
        raise APIError(413, f"tokens: more than {limit} tokens (the model's context length)", "tokens")
    bad = next((t for t in request.tokens if not 0 <= t < state.codec.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary", "tokens")
    return DetokenizeResponse(prompt=await state.sandbox.decode(request.tokens))


def build_app(config: GatewayConfig) -> FastAPI:
    # bad key or certificate files fail here, before the server starts
    tenants = Tenants.from_settings(config.api_key, config.api_keys_file, config.rate_limit_rps,
                                    config.rate_limit_burst)
    security = RpcSecurity.from_settings(config.rpc_token_file, config.rpc_tls_ca, config.rpc_tls_cert,
                                         config.rpc_tls_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        codec = TextCodec(config.model_dir)
        registry = CollectorRegistry()
        sandbox = TextSandbox(str(config.model_dir), config.text_workers, config.template_timeout_s,
                              config.max_prompt_chars)
        await sandbox.start()
        pool = WorkerPool(config.workers, config.stats_interval_s, security)
        await pool.start()
        sessions = await open_session_store(config.redis_url, config.session_key_prefix, config.session_ttl_s)
        state = GatewayState(config, codec, pool, sessions,
                             GatewayMetrics(registry, config.model_name, codec.max_model_len), sandbox,
                             fingerprint=fingerprint(config.model_name))
        app.state.gateway, app.state.registry = state, registry
        app.state.completions, app.state.chat = CompletionServing(state), ChatServing(state)
        _log_workers(pool, config)
        try:
            yield
        finally:
            await pool.close()
            await sessions.close()
            await sandbox.close()

    app = FastAPI(title="PagedWeight gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(router)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
    app.add_middleware(GatewayMiddleware, tenants=tenants, max_body_bytes=config.max_body_bytes,
                       max_header_bytes=config.max_header_bytes, body_timeout_s=config.body_timeout_s)
    return app


def fingerprint(model_name: str) -> str:
    """system_fingerprint: changes when the build or the served model does (as OpenAI's)."""
    import hashlib

    digest = hashlib.sha256(f"{metadata.version('pagedweight')}/{model_name}".encode()).hexdigest()[:10]
    return f"fp_{digest}"


async def _internal_error_handler(_: Request, err: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=err)
    return error_response(500, f"internal error: {type(err).__name__}")


def _log_workers(pool: WorkerPool, config: GatewayConfig) -> None:
    ready = pool.ready()
    log.info("workers: %d of %d ready (%s)", len(ready), len(pool.workers), ", ".join(pool.workers))
    for address, worker in pool.workers.items():
        if worker.stats is not None and worker.stats.model_name and worker.stats.model_name != config.model_name:
            log.warning("worker %s serves %r but this gateway calls the model %r (--served-model-name)",
                        address, worker.stats.model_name, config.model_name)
