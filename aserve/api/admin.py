"""Admin routes: the instance lifecycle over HTTP, behind a key of their own.

    GET    /admin/instances             every instance (role, state, load) and the recent flips
    POST   /admin/instances             {"role": "prefill" | "decode" | "coupled"}: add one (201)
    DELETE /admin/instances/{id}        drain it (no request is lost), then remove it
    POST   /admin/instances/{id}/flip   {"role": ...} optional: drain, then switch role

Reshaping the cluster is not inference: these routes take the admin key (``--admin-key``) and
nothing else. Without it they are off (403) unless ``--admin-open`` opens them to anyone who can
reach the port (a trusted loopback set-up). A missing or wrong key is a 401; the inference key
is a 403 (it is a key, just not one for this). Adding an instance allocates a KV pool: past
``--max-instances`` live instances an add is a 409 naming the flag.

Lifecycle refusals (the last instance of a role, an unknown id, one already changing) come back
as OpenAI-shaped 4xx errors, like every other error of the API.
"""
from __future__ import annotations

import hmac

from aiohttp import web

from aserve.api.context import ServerSettings
from aserve.api.errors import ApiError
from aserve.api.validate import parse_json, read_body
from aserve.cluster.lifecycle import InstanceError

ADMIN_PREFIX = "/admin"


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def _same(given: str, key: str) -> bool:
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


def check_admin(settings: ServerSettings, request: web.Request) -> None:
    """Let an admin request through, or raise its 401/403."""
    state = settings.admin_state
    if state == "open":
        return
    if state == "off":
        raise ApiError(403, "the admin routes are off: start the server with --admin-key KEY (or $ASERVE_ADMIN_KEY), "
                            "or --admin-open on a trusted loopback set-up", type_="permission_error",
                       code="admin_disabled")
    given = request.headers.get("Authorization", "")
    if _same(given, settings.admin_key):
        return
    if settings.api_key is not None and _same(given, settings.api_key):
        raise ApiError(403, "the inference API key does not open the admin routes: send the admin key "
                            "(--admin-key)", type_="permission_error", code="admin_key_required")
    raise ApiError(401, "Incorrect or missing admin key: send 'Authorization: Bearer <admin key>' (--admin-key)",
                   type_="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _refused(e: InstanceError) -> ApiError:
    return ApiError(e.status, str(e), "instance", type_="not_found_error" if e.status == 404 else
                    "invalid_request_error", code="instance_refused")


async def _body(request: web.Request, limit: int) -> dict:
    raw = await read_body(request, limit)
    return parse_json(raw) if raw.strip() else {}


def _role(body: dict, required: bool):
    role = body.get("role")
    if role is None and not required:
        return None
    if not isinstance(role, str):
        raise ApiError(400, "'role' must be a string: prefill, decode or coupled", "role")
    extra = sorted(set(body) - {"role"})
    if extra:
        raise ApiError(400, f"unknown field {extra[0]!r}", extra[0][:40])
    return role


def add_admin_routes(app: web.Application, key) -> None:
    """Register the routes; ``key`` is the app key of the ``ServeContext``."""

    async def list_instances(request: web.Request) -> web.Response:
        lifecycle = request.app[key].cluster.lifecycle
        return web.json_response({"object": "list", "data": lifecycle.instances_view(),
                                  "flips": lifecycle.flip_log[-50:], "failures": lifecycle.failure_log[-50:]})

    async def add(request: web.Request) -> web.Response:
        ctx = request.app[key]
        role = _role(await _body(request, ctx.settings.max_body_bytes), required=True)
        try:
            inst = await ctx.cluster.lifecycle.add(role, max_instances=ctx.settings.max_instances,
                                                   limit_flag="--max-instances")
        except InstanceError as e:
            raise _refused(e) from None
        view = next(v for v in ctx.cluster.lifecycle.instances_view() if v["id"] == inst.id)
        return web.json_response(view, status=201)

    async def remove(request: web.Request) -> web.Response:
        try:
            result = await request.app[key].cluster.lifecycle.remove(request.match_info["id"])
        except InstanceError as e:
            raise _refused(e) from None
        return web.json_response({"id": result["instance"], "removed": True, "drain_s": result["drain_s"]})

    async def flip(request: web.Request) -> web.Response:
        ctx = request.app[key]
        role = _role(await _body(request, ctx.settings.max_body_bytes), required=False)
        try:
            record = await ctx.cluster.lifecycle.flip(request.match_info["id"], role, reason="admin request")
        except InstanceError as e:
            raise _refused(e) from None
        return web.json_response(record)

    app.router.add_get("/admin/instances", list_instances)
    app.router.add_post("/admin/instances", add)
    app.router.add_delete("/admin/instances/{id}", remove)
    app.router.add_post("/admin/instances/{id}/flip", flip)
