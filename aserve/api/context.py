"""What the HTTP handlers share: the server's settings and its context over the cluster."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

from aserve.api.metrics import ServerMetrics
from aserve.cluster.cluster import Cluster
from aserve.cluster.snapshot import snapshot

MIB = 2**20


@dataclass(frozen=True)
class ServerSettings:
    """Knobs of the HTTP layer (the engine's are in EngineConfig / ClusterConfig)."""

    api_key: Optional[str] = None  # when set, every route but /health and /admin/* needs "Authorization: Bearer <key>"
    # /admin/* (add, remove, flip instances) need "Authorization: Bearer <admin_key>", never the api
    # key; without an admin key they are off (403) unless admin_open (a trusted loopback set-up)
    admin_key: Optional[str] = None
    admin_open: bool = False
    max_instances: int = 8  # POST /admin/instances refuses to go past this many live instances
    max_body_bytes: int = MIB
    # Cost of one request, bounded (docs/API.md, "Limits"). max_tokens: the most tokens a choice
    # may generate, and chat's default; None: as many as fit the context (vLLM's default)
    max_tokens: Optional[int] = 2048
    max_request_tokens: int = 32768  # n x (prompt + max_tokens), summed over a request's prompts
    max_logprob_entries: int = 2**18  # logprobs in one response: choices x (echoed prompt + max_tokens) x (k + 1)
    # choices (each of n x prompts is a request of the engine) waiting for their first token: a
    # request that would take the count past it gets 429; 0 = no limit
    max_queued_requests: int = 1024
    shutdown_timeout_s: float = 30.0  # in-flight requests get this long to finish on SIGINT/SIGTERM

    def __post_init__(self):
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None: what fits the context), got {self.max_tokens}")
        if self.max_request_tokens < 2 or self.max_logprob_entries < 1:
            raise ValueError(f"max_request_tokens must be >= 2 and max_logprob_entries >= 1, got "
                             f"{self.max_request_tokens} and {self.max_logprob_entries}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.admin_key is not None and not self.admin_key:
            raise ValueError("admin_key must not be empty")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("admin_key must differ from api_key: the inference key must not open the admin routes")
        if self.admin_key is not None and self.admin_open:
            raise ValueError("admin_open is for a server without an admin key; give one or the other")
        if self.max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {self.max_instances}")

    @property
    def admin_state(self) -> str:
        """How the admin routes answer: ``key`` (the admin key only), ``open`` or ``off`` (403)."""
        return "key" if self.admin_key is not None else "open" if self.admin_open else "off"


@dataclass
class ServeContext:
    """What the handlers share: the cluster, the settings, and the server's own small state."""

    cluster: "Cluster"
    settings: ServerSettings
    served_name: str
    model_names: frozenset
    metrics: Optional[ServerMetrics] = None
    tokenizer_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "aserve-tokenize"))
    pool_tokens: int = 0  # most tokens one request may reach: the smallest instance pool, less a slot
    draining: bool = False
    num_active: int = 0  # handlers with a request in the cluster
    num_rejected: int = 0  # generation requests refused with a 4xx or 5xx
    started_at: float = field(default_factory=time.monotonic)

    def snapshot(self) -> dict:
        snap = snapshot(self.cluster, self.served_name, self.started_at, self.draining)
        if self.num_rejected:  # refused generations: an outcome the API, not the cluster, knows
            snap["counts"]["rejected"] = self.num_rejected
        return snap

    def engine_dead(self) -> Optional[str]:
        """Why the cluster cannot serve, or None: dead only when a role it needs has no live
        instance left (a failed instance whose requests moved elsewhere is not death)."""
        if not self.cluster.started:
            return "the cluster is not running"
        live = {inst.role for inst in self.cluster.instances.values()
                if inst.state not in ("failed", "removed") and inst.is_running}
        need = {"prefill", "decode"} if self.cluster.cfg.split else {"coupled"}
        missing = sorted(need - live)
        return f"no live {' or '.join(missing)} instance" if missing else None


CTX = web.AppKey("aserve", ServeContext)
