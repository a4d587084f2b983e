"""The Starlette app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every error, from a bad field to an unknown route, is answered in OpenAI's format; a client that goes away (a
closed stream, or a dropped connection while a non-streaming request runs) aborts its request in the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import protocol as P
from .async_engine import AsyncEngine, QueueFull, RequestStream

log = logging.getLogger("speedcore.server")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: Optional[str] = None
    max_request_bytes: int = 2 << 20  # request bodies past this: 413
    max_prompt_chars: int = 1 << 20  # text prompts / chat messages past this many characters: 413 before tokenizing


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class EventStream:
    """A server-sent-event response that aborts its request the moment the client disconnects (a watcher on
    ``receive`` sees http.disconnect even while the request still waits for its first token)."""

    def __init__(self, events, stream: RequestStream):
        self.events, self.stream = events, stream

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.stream))
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            pass
        finally:
            watcher.cancel()
            self.stream.abort()  # a no-op once finished
            await self.events.aclose()


async def _watch_disconnect(receive, stream: RequestStream) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            stream.abort()
            return


def build_app(engine: AsyncEngine, config: ServerConfig) -> Starlette:
    backend = engine.backend
    tokenizer = backend.tokenizer
    token_text = P.TokenText(tokenizer)
    max_model_len = backend.max_model_len
    metrics = engine.metrics
    key = config.api_key.encode("utf-8") if config.api_key else None

    # -- request helpers ----------------------------------------------------------------------------------------
    async def read_body(request: Request) -> dict:
        """The JSON body, or 413 past the limit.  An oversized body is read on and dropped up to 16x the limit
        before answering, so that a client still sending it reads the 413 instead of a reset connection; past
        that the connection is closed."""
        limit = config.max_request_bytes
        cl = request.headers.get("content-length")
        declared = int(cl) if cl is not None and cl.isdigit() else None
        if declared is not None and declared > 16 * limit:
            raise P.APIError(413, f"the request body has {declared} bytes; this server takes at most {limit}",
                             code="request_too_large", headers={"Connection": "close"})
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit or (declared is not None and declared > limit):
                if size > 16 * limit:
                    break
                continue
            chunks.append(chunk)
        if size > limit or (declared is not None and declared > limit):
            e = P.APIError(413, f"the request body has {max(size, declared or 0)}{'+' if size > 16 * limit else ''} "
                                f"bytes; this server takes at most {limit}", code="request_too_large")
            if size > 16 * limit:
                e.headers = {"Connection": "close"}
            raise e
        return P.parse_json_body(b"".join(chunks))

    def encode_prompt(req: P.GenerationRequest):
        """(text, token ids) of the prompt: runs in a worker thread (long prompts take a while to tokenize)."""
        if req.kind == "chat":
            try:
                text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                                     **req.chat_template_kwargs)
            except Exception as e:  # jinja2's TemplateError (e.g. roles that do not alternate), a bad kwarg, ...
                raise P.bad(f"messages: the chat template refused them: {e}", "messages") from None
            return text, tokenizer.encode(text, add_special_tokens=False)  # the template writes the BOS itself
        if req.prompt_token_ids is not None:
            return None, req.prompt_token_ids
        return req.prompt, tokenizer.encode(req.prompt)

    def check_lengths(req: P.GenerationRequest, n_prompt: int) -> int:
        if n_prompt == 0:
            raise P.bad("prompt: empty (no tokens)", "prompt")
        if n_prompt >= max_model_len:
            raise P.bad(f"This model's maximum context length is {max_model_len} tokens; the prompt has {n_prompt} "
                        f"tokens, which leaves no room for output", "messages" if req.kind == "chat" else "prompt",
                        code="context_length_exceeded")
        room = max_model_len - n_prompt
        if req.max_tokens is None:
            return room
        if req.max_tokens > room:
            raise P.bad(f"This model's maximum context length is {max_model_len} tokens; you requested "
                        f"{n_prompt + req.max_tokens} ({n_prompt} in the prompt, {req.max_tokens} for the completion)."
                        f" Reduce the prompt or max_tokens", "max_tokens", code="context_length_exceeded")
        return req.max_tokens

    async def generate(request: Request, kind: str):
        arrival = time.perf_counter()
        body = await read_body(request)
        if kind == "chat":
            if tokenizer is None:
                raise P.bad("this model has no tokenizer, so no chat template: use /v1/completions with token ids",
                            "messages")
            req = P.parse_chat(body, config.served_model_name)
            size = sum(len(m["content"]) for m in req.messages)
        else:
            req = P.parse_completion(body, config.served_model_name, backend.vocab_size)
            if req.prompt is not None and tokenizer is None:
                raise P.bad("this model has no tokenizer: the prompt must be an array of token ids", "prompt")
            size = len(req.prompt or "")
        if size > config.max_prompt_chars:
            raise P.APIError(413, f"the prompt has {size} characters; this server takes at most "
                             f"{config.max_prompt_chars}", param="messages" if kind == "chat" else "prompt",
                             code="prompt_too_large")
        if req.prompt_token_ids is not None:
            text, ids = None, req.prompt_token_ids
        else:
            text, ids = await asyncio.get_running_loop().run_in_executor(None, encode_prompt, req)
        params = req.sampling_params(check_lengths(req, len(ids)))
        try:
            stream = engine.submit(text, ids, params, arrival=arrival)
        except QueueFull as e:
            raise P.APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
        rid = P.new_id(kind)
        if req.stream:
            return EventStream(stream_events(req, rid, stream), stream)
        return await collect(request, req, rid, stream, ids)

    async def stream_events(req, rid, stream: RequestStream):
        w = P.ChunkWriter(req, rid, token_text)
        first = w.first()
        if first is not None:
            yield first
        n_out, cached = 0, 0
        while True:
            d = await stream.next()
            if d is None:  # aborted: the client is gone, nothing more to write
                return
            if d.error is not None:
                yield P.sse(P.APIError(500, f"generation failed: {d.error}", code="generation_failed").body())
                yield P.DONE
                return
            n_out, cached = d.num_output_tokens, d.num_cached_tokens
            yield w.delta(d)
            if d.finished:
                break
        if req.include_usage:
            yield w.usage(stream.num_prompt_tokens, n_out, cached)
        yield P.DONE

    async def collect(request: Request, req, rid, stream: RequestStream, prompt_ids):
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, stream))
        text, ids, lps, last = [], [], [], None
        try:
            while True:
                d = await stream.next()
                if d is None:
                    return Response(status_code=499)  # the client is gone: nobody reads this
                if d.error is not None:
                    raise P.APIError(500, f"generation failed: {d.error}", code="generation_failed")
                text.append(d.text)
                ids += d.token_ids
                if d.logprobs:
                    lps += d.logprobs
                last = d
                if d.finished:
                    break
        finally:
            watcher.cancel()
            stream.abort()
        return JSONResponse(P.full_response(req, rid, "".join(text), ids, lps, last.finish_reason, last.stop_reason,
                                            stream.num_prompt_tokens, last.num_cached_tokens, token_text,
                                            prompt_ids))

    # -- endpoints ----------------------------------------------------------------------------------------------
    async def completions(request: Request):
        return await generate(request, "completion")

    async def chat_completions(request: Request):
        return await generate(request, "chat")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": config.served_model_name, "object": "model", "created": int(started), "owned_by": "speedcore",
             "max_model_len": max_model_len}]})

    async def health(request: Request):
        if not engine.alive:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(request: Request):
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- errors -------------------------------------------------------------------------------------------------
    async def api_error(request, e: P.APIError):
        return error_response(e)

    async def http_error(request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(P.APIError(e.status_code, msg, code=code))

    async def server_error(request, e: Exception):
        log.exception("speedcore server: unhandled error")
        return error_response(P.APIError(500, f"internal error ({type(e).__name__}); see the server log"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    started = time.time()
    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_endpoint, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={P.APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.engine = engine
    app.state.config = config
    return _Guard(app, key, metrics)


class _Guard:
    """Outermost ASGI layer: the API key (every path but /health needs it when one is set, compared in constant
    time) and the count of responses by status for /metrics."""

    def __init__(self, app, key: Optional[bytes], metrics):
        self.app, self.key, self.metrics = app, key, metrics
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                self.metrics.http_responses.inc(code=str(msg["status"]))
            await send(msg)

        if self.key is not None and scope["path"] != "/health":
            auth = b""
            for k, v in scope["headers"]:
                if k == b"authorization":
                    auth = v
                    break
            scheme, _, token = auth.partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            if not ok:
                e = P.APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await error_response(e)(scope, receive, counting_send)
        return await self.app(scope, receive, counting_send)
