"""The OpenAI-compatible application: routes, middlewares, and the handlers' shared context.

    GET  /health               200, or 503 when the engine is dead or the server drains (no key needed)
    GET  /v1/models            the served model
    POST /v1/chat/completions  chat, streaming (SSE) or not
    POST /v1/completions       text completion, streaming (SSE) or not
    GET  /metrics              Prometheus text (vllm: and aserve: names)
    GET  /v1/stats             JSON snapshot of every instance and link, for the live monitor
    GET|POST /admin/instances, DELETE /admin/instances/{id}, POST /admin/instances/{id}/flip
                               the instance lifecycle (aserve/api/admin.py), behind the admin key

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``) and bad input
is always a 4xx. ``build_app`` makes the application over a started cluster; ``aserve/api/server.py``
binds it, drains it and gives it its command line.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from aserve.api.admin import add_admin_routes, check_admin, is_admin_path
from aserve.api.context import CTX, ServeContext, ServerSettings
from aserve.api.generate import generate
from aserve.api.metrics import ServerMetrics
from aserve.api.errors import ApiError

log = logging.getLogger("aserve.api")


# ---- middlewares -------------------------------------------------------------------------------
def _error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers)


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error leaves as OpenAI-shaped JSON; an unexpected one is a logged 500."""
    try:
        return await handler(request)
    except ApiError as e:
        if request.method == "POST" and request.path.startswith("/v1/"):  # a refused generation
            ctx = request.app[CTX]
            ctx.num_rejected += 1
            ctx.cluster.log.log("rejected", None, f"{e.status} {request.path}: {e.message[:80]}")
        return _error_response(e)
    except web.HTTPException as e:  # aiohttp's own: unknown route (404), wrong method (405)
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        headers = {k: v for k, v in e.headers.items() if k == "Allow"}
        return _error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path[:100]}",
                                        type_=kind, headers=headers))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(ApiError(500, "internal server error", type_="server_error"))


@web.middleware
async def _auth(request: web.Request, handler):
    """The admin routes take their own key (aserve/api/admin.py); every other route but /health
    takes the API key, when one is set."""
    settings = request.app[CTX].settings
    key = settings.api_key
    if is_admin_path(request.path):
        check_admin(settings, request)
    elif key is not None and request.path != "/health":
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


# ---- small routes --------------------------------------------------------------------------------
def _model_card(ctx: ServeContext) -> dict:
    return {"id": ctx.served_name, "object": "model", "created": int(time.time()), "owned_by": "aserve",
            "max_model_len": ctx.cluster.bundle.args.max_position}


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[CTX])]})


async def _model(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    if request.match_info["model"] not in ctx.model_names:
        raise ApiError(404, "The model does not exist", "model", code="model_not_found")
    return web.json_response(_model_card(ctx))


async def _health(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    dead = ctx.engine_dead()
    if dead or ctx.draining:
        return web.json_response({"status": "dead" if dead else "draining", "detail": dead}, status=503)
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[CTX].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[CTX].snapshot())


def build_app(cluster, served_name: str, settings: ServerSettings = ServerSettings(),
              aliases: tuple[str, ...] = ()) -> web.Application:
    """The application over a *started* cluster. Accepted model names: ``served_name``,
    ``"default"`` and ``aliases``."""
    assert cluster.started, "start the cluster first"
    ctx = ServeContext(cluster, settings, served_name, frozenset((served_name, "default", *aliases)))
    ctx.metrics = ServerMetrics(served_name, ctx.snapshot)
    ctx.pool_tokens = min(i.blocks.num_blocks * i.blocks.block_size for i in cluster.instances.values()) - 1
    app = web.Application(middlewares=[_errors, _auth], client_max_size=settings.max_body_bytes)
    app[CTX] = ctx
    app.router.add_post("/v1/chat/completions", lambda r: generate(r.app[CTX], r, "chat"))
    app.router.add_post("/v1/completions", lambda r: generate(r.app[CTX], r, "completion"))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/stats", _stats)
    add_admin_routes(app, CTX)

    async def _close_pool(_app):
        ctx.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_close_pool)
    return app
