"""The OpenAI-compatible HTTP app around one engine client: a worker's local engine, or
the router's remote one.

FastAPI on uvicorn: an ASGI stack whose streaming responses notice client disconnects
(which lets us abort the request and free its KV blocks), with pydantic models for
validation; both are the de-facto standard of Python model servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from xlserve import native_heap
from xlserve.openai.engine_client import EngineBusy, EngineDead, RequestFailed
from xlserve.openai.errors import ApiError, error_body
from xlserve.openai.event_stream import EventStreamResponse
from xlserve.openai.http_edge import HostGuard, allowed_hosts, check_json_content_type
from xlserve.openai.openapi_doc import document_body, openapi_document
from xlserve.openai.pricing import PriceTable
from xlserve.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from xlserve.openai.protocol_responses import ResponsesRequest
from xlserve.openai.response_store import ResponseStore
from xlserve.openai.serving_chat import ChatHandler
from xlserve.openai.serving_common import WorkerState
from xlserve.openai.serving_completion import CompletionHandler
from xlserve.openai.serving_responses import ResponsesHandler
from xlserve.openai.serving_tokens import TokenHandler
from xlserve.server_config import ServerConfig

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25


def _validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        where = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


async def read_body(request: Request, limit: int) -> bytes:
    check_json_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def parse_json(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ApiError(400, _validation_message(e)) from e


async def read_json(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    return parse_json(await read_body(request, limit), model)


class ClientGone(Exception):
    """The client disconnected while its request was being worked on."""


async def until_disconnected(request: Request, work):
    """Await ``work``; cancel it (aborting the generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


def build_app(state: WorkerState, config: ServerConfig, internal: bool = True,
              request_hook=None, response_headers=None, title: str = "xlserve worker", dispatch=None) -> FastAPI:
    """The OpenAI-compatible app. ``internal``: add the disaggregation endpoints (workers);
    ``request_hook(request)``: called first on each generation request (the router reads
    its session header there); ``response_headers()``: extra response headers (the router
    names the workers it routed to); ``dispatch(request, body, req, prepared, local)``: the
    router's choice of server for a parsed request, ``local()`` being this app's own path."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None,  # served below, behind the key
                  lifespan=_run_startup_hooks)
    app.state.startup_hooks = [freeze_startup_heap]  # awaited in order before the first request
    if config.heap_trim_interval > 0:
        async def _trim_heap():
            app.state.heap_trim_task = asyncio.create_task(native_heap.trim_every(config.heap_trim_interval))
        app.state.startup_hooks.append(_trim_heap)
    logging.getLogger("xlserve.requests").disabled = not config.log_requests
    hosts = allowed_hosts(config.host, config.allowed_hosts)
    if hosts is not None:
        app.add_middleware(HostGuard, allowed=hosts)
    state.prices = PriceTable(config.price_input, config.price_cached_input, config.price_output)
    error_response = _add_error_handlers(app, state)
    # A key on every door: public routes take the API key, internal ones the internal key;
    # a worker with only one of them guards both with it (the router has no internal routes).
    public_key = config.api_key or (config.internal_api_key if internal else "")
    internal_key = config.internal_api_key or config.api_key
    api = key_check(public_key)
    app.state.api_dependencies = api
    _add_status_routes(app, state, config, api, error_response)

    async def respond(request: Request, model: type[BaseModel], handler):
        if request_hook is not None:
            request_hook(request)
        body = await read_body(request, config.max_body_bytes)

        def parse_and_prepare():
            req = parse_json(body, model)
            return req, handler.prepare(req)
        req, prepared = await state.preprocessor.run(parse_and_prepare, len(body))

        async def local():
            work = handler.stream(req, prepared) if req.stream else handler.complete(req, prepared)
            result = await until_disconnected(request, work)  # a refusal raises here, before any byte
            headers = response_headers() if response_headers else None
            if req.stream:
                return EventStreamResponse(result, headers=headers)
            return JSONResponse(result, headers=headers)
        return await (dispatch(request, body, req, prepared, local) if dispatch is not None else local())

    def endpoint(model: type[BaseModel], handler):
        async def handle(request: Request):
            return await respond(request, model, handler)
        return handle

    chat = ChatHandler(state, config.tool_parser, config.reasoning_parser)
    tokens = TokenHandler(state)
    responses = ResponsesHandler(chat, ResponseStore(config.responses_kept))
    for path, model, handler in (("/v1/chat/completions", ChatCompletionRequest, chat),
                                 ("/v1/completions", CompletionRequest, CompletionHandler(state)),
                                 ("/v1/responses", ResponsesRequest, responses),
                                 ("/tokenize", TokenizeRequest, tokens), ("/detokenize", DetokenizeRequest, tokens)):
        app.add_api_route(path, endpoint(model, handler), methods=["POST"], dependencies=api)
        document_body(app, path, model)
    _add_response_store_routes(app, responses.store, api)

    @app.get("/openapi.json", dependencies=api, include_in_schema=False)
    async def openapi():
        return JSONResponse(openapi_document(app))
    if internal:  # imported here: it needs torch (KV transfer), which the router never loads
        from xlserve.worker.internal import add_internal_routes
        app.state.disaggregation = add_internal_routes(app, state, config, key_check(internal_key), read_json)
    return app


def key_check(key: str) -> list:
    """The dependency that wants ``Authorization: Bearer <key>`` (none when ``key`` is empty).
    A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware hides client
    disconnects from the endpoint, and we abort generations on disconnect."""
    async def check(request: Request):
        given = request.headers.get("authorization", "")
        if key and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return [Depends(check)]


def _add_error_handlers(app: FastAPI, state: WorkerState):
    """Every failure as an OpenAI error body (refusals counted by status); returns the
    function that makes one."""
    def error_response(status: int, message: str, **kw) -> JSONResponse:
        state.metrics.errors.labels(status=str(status)).inc()
        headers = {"Retry-After": "1"} if status == 429 else None
        return JSONResponse(error_body(status, message, **kw), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, param=e.param, code=e.code)

    @app.exception_handler(EngineBusy)
    async def _busy(_, e: EngineBusy):
        return error_response(429, f"server busy: {e}; retry later")

    @app.exception_handler(EngineDead)
    async def _dead(_, e: EngineDead):
        return error_response(503, f"engine unavailable: {e}")

    @app.exception_handler(RequestFailed)
    async def _failed(_, e: RequestFailed):
        return error_response(500, f"the request failed: {e}", code="request_failed")

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _gone(_, e: Exception):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):  # a query or path parameter of the wrong type
        where = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:5])
        return error_response(400, where or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))
    return error_response


def _add_status_routes(app: FastAPI, state: WorkerState, config: ServerConfig, api: list, error_response) -> None:
    """Liveness, readiness, metrics and the model cards."""
    @app.get("/health")
    async def health():
        """Liveness (restart me if not 200): the engine runs and no step hangs."""
        problem = state.async_engine.health_problem(config.hang_timeout)
        return error_response(503, problem) if problem else {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """Readiness (send me requests if 200): alive, and a healthy worker for every stage."""
        engine = state.async_engine
        problem = engine.health_problem(config.hang_timeout) or engine.readiness_problem()
        return error_response(503, problem) if problem else {"status": "ready"}

    @app.get("/metrics", dependencies=api if config.metrics_need_key else [])
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "xlserve",
                "max_model_len": state.max_model_len}

    @app.get("/v1/models", dependencies=api)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=api)
    async def model(model_id: str):
        if model_id != state.model_name:
            raise ApiError(404, f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")
        return model_card()


def _add_response_store_routes(app: FastAPI, store: ResponseStore, api: list) -> None:
    def missing(response_id: str) -> ApiError:
        return ApiError(404, f"response {response_id!r} is not (or no longer) kept by this server")

    @app.get("/v1/responses/{response_id}", dependencies=api)
    async def get_response(response_id: str):
        kept = store.get(response_id)
        if kept is None:
            raise missing(response_id)
        return kept.response

    @app.delete("/v1/responses/{response_id}", dependencies=api)
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise missing(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


@contextlib.asynccontextmanager
async def _run_startup_hooks(app: FastAPI):
    """The app's lifespan: ``app.state.startup_hooks`` (the router adds its first health
    check), then serve."""
    for hook in app.state.startup_hooks:
        await hook()
    yield


async def freeze_startup_heap() -> None:
    """Keep what the server built before its first request (the model, tokenizer, modules)
    out of the cyclic collector's work: a full collection walks every tracked object, and
    CPython runs one only when the objects that survived since the last grew by a quarter,
    so on a heap of startup objects the cycles each request leaves (httpx's requests and
    responses hold one another) wait a long time, and each full pass stalls the event loop
    for as long as the walk takes. vLLM and SGLang freeze their servers' heaps the same way."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("startup heap frozen: %d objects, %.0f ms", gc.get_freeze_count(), 1e3 * (time.perf_counter() - started))
