"""Admin routes: the instance lifecycle over HTTP (they need the API key when one is set).

    GET    /admin/instances             every instance (role, state, load) and the recent flips
    POST   /admin/instances             {"role": "prefill" | "decode" | "coupled"}: add one (201)
    DELETE /admin/instances/{id}        drain it (no request is lost), then remove it
    POST   /admin/instances/{id}/flip   {"role": ...} optional: drain, then switch role

Lifecycle refusals (the last instance of a role, an unknown id, one already changing) come back
as OpenAI-shaped 4xx errors, like every other error of the API.
"""
from __future__ import annotations

from aiohttp import web

from aserve.api.errors import ApiError
from aserve.api.validate import parse_json, read_body
from aserve.cluster.lifecycle import InstanceError


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
            inst = await ctx.cluster.lifecycle.add(role)
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
