"""A real aserve HTTP server on loopback, in a background thread with its own event loop.

Tests talk to it over TCP with real clients (openai, aiohttp, http.client): no mocks. The
model bundle is loaded once per test process and shared by every server (a bundle is
read-only; each cluster has its own KV pools).
"""
from __future__ import annotations

import asyncio
import functools
import http.client
import json
import threading
import time
from typing import Optional

import pytest

from aserve.api.server import ApiServer, ServerSettings
from aserve.cluster.cluster import Cluster
from aserve.config import ClusterConfig, EngineConfig

# bf16 on this CPU (auto); 0.25 GiB of KV per instance is ~700 blocks of 16 tokens for SmolLM2-135M.
# One torch thread in all: the test machine's cores are shared, and a multi-threaded step whose
# threads spin-wait on a busy core slows down tenfold.
ENGINE = EngineConfig(kv_cache_gb=0.25, num_threads=1)


@functools.lru_cache(maxsize=1)
def bundle():
    from aserve.engine.bundle import ModelBundle

    return ModelBundle.load(ENGINE)


class ServerThread:
    """``with ServerThread(ClusterConfig(...), ServerSettings(...)) as s: s.url ...``"""

    def __init__(self, cluster_cfg: ClusterConfig, settings: ServerSettings = ServerSettings(),
                 engine: EngineConfig = ENGINE, model_bundle=None):
        """``model_bundle``: a loaded bundle matching ``engine`` (default: the shared bf16 one)."""
        self.cluster_cfg, self.settings, self.engine = cluster_cfg, settings, engine
        self.model_bundle = model_bundle
        self.port: Optional[int] = None
        self.server: Optional[ApiServer] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name="aserve-test-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise RuntimeError("server failed to start") from self._error
        assert self.port, "server did not start in time"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # surfaced by __enter__
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with Cluster(self.engine, self.cluster_cfg, bundle=self.model_bundle or bundle()) as cluster:
            self.server = ApiServer(cluster, "smollm2-135m-instruct", self.settings)
            self.port = await self.server.start("127.0.0.1", 0)
            self._ready.set()
            await self._stop.wait()
            await self.server.shutdown(timeout_s=0)

    # ---- small synchronous client --------------------------------------------------------------
    def request(self, method: str, path: str, body=None, headers: Optional[dict] = None,
                timeout: float = 120, auth: bool = True) -> tuple[int, dict, bytes]:
        """One HTTP exchange; ``body`` is bytes, or anything JSON-serialisable. ``auth`` sends the
        server's api key, when it has one."""
        base = {"Content-Type": "application/json"}
        if auth and self.settings.api_key:
            base["Authorization"] = f"Bearer {self.settings.api_key}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            raw = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, body=raw, headers={**base, **(headers or {})})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def stats(self) -> dict:
        status, _, body = self.request("GET", "/v1/stats")
        assert status == 200, body
        return json.loads(body)

    def wait_idle(self, timeout: float = 60) -> dict:
        """Poll /v1/stats until no request is in flight and every block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.stats()
            idle = snap["num_requests"] == 0 and all(
                i["free_blocks"] == i["total_blocks"] and i["num_requests"] == 0 for i in snap["instances"])
            idle = idle and all(link["in_flight"] == 0 for link in snap["links"])
            if idle:
                return snap
            assert time.monotonic() < deadline, f"not idle after {timeout} s: {json.dumps(snap)[:2000]}"
            time.sleep(0.1)


def sse_events(raw: bytes) -> list:
    """The JSON payloads of an SSE body, with the final ``[DONE]`` as the string "[DONE]"."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def iter_sse(resp):
    """Yield SSE payloads as they arrive on a streaming aiohttp response ("[DONE]" as a string)."""
    buf = b""
    async for piece in resp.content.iter_any():
        buf += piece
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            data = block.decode()[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


# ---- fixtures a test module imports (one coupled server on the default model per module) ----------
@pytest.fixture(scope="module")
def coupled_server():
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1)) as s:
        yield s


def openai_client(server: ServerThread, timeout: float = 120):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
