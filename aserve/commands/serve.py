"""``aserve serve``: the OpenAI-compatible HTTP server in the cluster's own process and loop.

    aserve serve [MODEL] [--mode coupled --instances N --batching B | --mode disagg --prefill P --decode D
                  | --mode adaptive --prefill P --decode D] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                 [--admin-key KEY | --admin-open] [--max-instances 8]

MODEL is positional as ``vllm serve MODEL`` takes it; ``--model MODEL`` (the engine flag every
command shares) is the same thing and keeps working; both given and different is an error.

``serve`` defaults to ``SERVE_MODE`` (two coupled Sarathi instances, one a core here): in the peer
table (docs/notes/peer.md, issue 28), under guidellm at 1, 8 and 32 streams, it had the highest
output tokens/s of aserve's configurations at 32 streams and tied them at 1 and 8, while 1 prefill
+ 1 decode fell behind at 32 streams (one prefill core cannot keep up with 32 streams' prompts).
``replay`` keeps disagg as its default: the paper's system is what a replay measures.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading
from typing import Optional

from aserve.commands.common import add_cluster_args, add_engine_args, engine_and_cluster, parse_options
from aserve.commands.serve_predictor import serve_predictor
from aserve.event_loop import run as run_loop

SERVE_MODE = "coupled"  # the peer table's winner on this machine (see the module docstring)

# After SIGINT/SIGTERM the process is gone within --shutdown-timeout + EXIT_MARGIN_S on any machine:
# the drain's own waits are bounded (aserve/api/server.py), the cluster waits STOP_WAIT_S at most
# for the steps and copies still on device threads, and past EXIT_DEADLINE_S the process leaves
# without waiting for threads that are still busy (a step that will not end, on some machine).
EXIT_MARGIN_S = 5.0
STOP_WAIT_S = 1.5
EXIT_DEADLINE_S = EXIT_MARGIN_S - 0.5
EXIT_OVERRAN = 1


def register(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` and its flags (the CLI's engine and cluster flags, plus the server's)."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, SSE, /metrics)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as 'vllm serve MODEL' takes it: the same as --model (default: 'default', "
                        "SmolLM2-135M-Instruct, bundled)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $ASERVE_API_KEY; /health stays open)")
    s.add_argument("--admin-key", default=None,
                   help="turn on the admin routes (/admin/*: add, remove, flip instances), which then need "
                        "'Authorization: Bearer KEY' and no other key (default: $ASERVE_ADMIN_KEY; none: they are off)")
    s.add_argument("--admin-open", action="store_true",
                   help="admin routes without a key, for a trusted loopback set-up (refused with a non-loopback --host)")
    s.add_argument("--max-instances", type=int, default=8,
                   help="POST /admin/instances refuses past this many live instances, each with its own KV pool (default 8)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: the folder name)")
    s.add_argument("--max-body-bytes", type=int, default=2**20, help="larger request bodies get 413 (default 1 MiB)")
    s.add_argument("--max-tokens", type=max_tokens_arg, default=2048, metavar="N|context",
                   help="tokens a choice may generate at most, and chat's default when a request gives none "
                        "(default 2048; context: as many as fit the context window, vLLM's default)")
    s.add_argument("--max-request-tokens", type=int, default=32768,
                   help="n x (prompt + max_tokens) over a request's prompts, at most (default 32768)")
    s.add_argument("--max-logprob-entries", type=int, default=2**18,
                   help="logprobs one response may carry: choices x (echoed prompt + max_tokens) x (k + 1) "
                        "(default 262144)")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="choices (n x prompts of each request) that may wait for their first token; a request "
                        "past it gets 429 (default 1024; 0: no limit)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (then: abort)")
    s.add_argument("--tui", action="store_true", help="draw the live monitor in this terminal (docs/MONITOR.md)")
    s.add_argument("--slo", default="balanced", metavar="CORNER|ttft:MS,tpot:MS",
                   help="the SLO the server is run for, printed at start-up: a corner (balanced, tight-ttft, "
                        "tight-tpot: multiples of the device's own unloaded costs, aserve/replay/slo.py) or limits "
                        "(ttft:250,tpot:100, milliseconds); a chunked system's token budget is sized for it "
                        "(--tbt-slo gap by default). Default: balanced")
    add_cluster_args(p, default_mode=SERVE_MODE)
    add_engine_args(p)
    # None: serve_predictor.py picks, and says why. Cores follow the load when serving: a lone prompt
    # prefills on every core (TTFT at one stream 746 against 450 ms, docs/notes/peer.md, issue 60)
    # Steps sized at their decodes' contexts: a budget sized for 32 decodes at 8,192 tokens of context
    # holds 48 prompt rows; at a chat's few hundred, a step has room for hundreds (issue 60)
    p.set_defaults(func=cmd_serve, predictor=None, device_share="lend", sized_steps=True)
    return p


def serve_model(a: argparse.Namespace) -> argparse.Namespace:
    """Fold the positional MODEL into ``a.model`` (the engine flag), as ``vllm serve MODEL`` takes it.
    Both given and different is an error naming both (``--model default``, its default, counts as not given)."""
    if a.model_tag is not None:
        if a.model not in ("default", a.model_tag):
            raise ValueError(f"the model is given twice: MODEL {a.model_tag!r} and --model {a.model!r}; give one")
        a.model = a.model_tag
    return a


def server_settings(a: argparse.Namespace):
    from aserve.api.context import ServerSettings

    # the environment is read here, in the CLI layer, and nowhere deeper
    key = a.api_key if a.api_key is not None else os.environ.get("ASERVE_API_KEY") or None
    admin_key = a.admin_key if a.admin_key is not None else os.environ.get("ASERVE_ADMIN_KEY") or None
    if a.admin_open and not is_loopback(a.host):
        raise ValueError(f"--admin-open opens the admin routes to anyone who reaches the port; --host {a.host} is "
                         "not loopback: use --admin-key KEY instead")
    if a.admin_open and admin_key is not None:
        raise ValueError("--admin-open and an admin key (--admin-key or $ASERVE_ADMIN_KEY) exclude each other")
    if admin_key is not None and admin_key == key:
        raise ValueError("--admin-key must differ from the API key: the inference key must not open the admin routes")
    return ServerSettings(api_key=key, admin_key=admin_key, admin_open=a.admin_open, max_instances=a.max_instances,
                          max_body_bytes=a.max_body_bytes, max_tokens=a.max_tokens,
                          max_request_tokens=a.max_request_tokens, max_logprob_entries=a.max_logprob_entries,
                          max_queued_requests=a.max_queued_requests, shutdown_timeout_s=a.shutdown_timeout)


def serve_slo(a: argparse.Namespace):
    """``--slo`` as an ``Slo``; a corner reads the device's unloaded costs (its profile, measured
    once and cached) only where something needs them: the token budget sized for it."""
    from aserve.commands.common import bundle_engine, instance_threads
    from aserve.commands.slo_args import device_label
    from aserve.devices.factory import device_cost
    from aserve.replay.slo import UnloadedCosts, build_slo

    return build_slo(a.slo, None, lambda: UnloadedCosts(lambda: device_cost(bundle_engine(a), instance_threads(a)),
                                                        device_label(a)))


def slo_line(a: argparse.Namespace, slo, engine, cluster) -> str:
    """The start-up line: the SLO in force, its limits at the budget's context, and the budgets it sized."""
    from aserve.commands.slo_budget import budget_context

    parts = [f"{key} <= {term.text(key)}" for key, term in slo.terms]
    line = f"SLO {slo.name} ({'; '.join(parts)})"
    if slo.relative and slo.costs.resolved:
        ctx = budget_context(a, None)
        values = slo.limits(ctx // 2, ctx - ctx // 2)
        line += f" on {slo.costs.device}; at {ctx} tokens of context: " + ", ".join(
            f"{k} {v * 1000:.0f} ms" for k, v in values.items())
    budget = f"token budget {engine.max_num_batched_tokens}"
    if engine.tbt_slo is not None:
        budget += f" (steps <= {engine.tbt_slo * 1000:.0f} ms"
        budget += f", sized for this SLO's {a.tbt_slo or 'gap'})" \
            if not isinstance(a.tbt_slo, float) else ", --tbt-slo)"
    if cluster.mode == "adaptive" and cluster.prefill_token_budget:
        budget += f", prefill instances {cluster.prefill_token_budget} (steps <= {cluster.prefill_tbt_slo * 1000:.0f} ms)"
    if engine.step_budget == "sized" and engine.batching == "sarathi" and cluster.mode != "adaptive":
        limit = engine.step_limit_s or engine.tbt_slo
        budget += ("; a step's prompts may take more, as far as its decodes' contexts leave room in "
                   + (f"{limit * 1000:.0f} ms" if limit else "that time"))
        if engine.step_limit_alone_s is not None:
            budget += f" ({engine.step_limit_alone_s * 1000:.0f} ms in a step with no decodes)"
    return f"{line}; {budget}"


def max_tokens_arg(value: str) -> Optional[int]:
    """``--max-tokens``: a count >= 1, or ``context`` (None: what fits the context window)."""
    if value == "context":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or 'context', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or 'context'), got {n}")
    return n


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def startup_notes(settings, host: str) -> list[str]:
    """What ``aserve serve`` says at start about who may use it: the admin routes' state, and a
    warning when it listens beyond this machine with no API key."""
    notes = {"off": "admin routes (/admin/*) are off: start with --admin-key KEY (or $ASERVE_ADMIN_KEY) to add, "
                    "remove or flip instances over HTTP",
             "key": f"admin routes (/admin/*) need the admin key; at most {settings.max_instances} instances "
                    "(--max-instances)",
             "open": f"admin routes (/admin/*) are open without a key (--admin-open); at most {settings.max_instances} "
                     "instances (--max-instances)"}
    out = [notes[settings.admin_state]]
    if not is_loopback(host) and settings.api_key is None:
        out.append(f"WARNING: listening on {host} with no API key: anyone who reaches this port can run generations "
                   "on it; set --api-key KEY (or $ASERVE_API_KEY)")
    return out


def cmd_serve(a: argparse.Namespace) -> int:
    serve_model(a)
    a.predictor, why = serve_predictor(a, parse_options(a.predictor_option, "predictor-option"))
    slo = serve_slo(a)
    (engine, cluster_cfg), settings = engine_and_cluster(a, slo=slo), server_settings(a)
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    num = cluster_cfg.num_prefill + cluster_cfg.num_decode if cluster_cfg.split else cluster_cfg.num_coupled
    if num > settings.max_instances:
        raise ValueError(f"{num} instances asked for at start, more than --max-instances {settings.max_instances}")
    print(f"aserve: length predictor {a.predictor} ({why})", file=sys.stderr, flush=True)
    print(f"aserve: {slo_line(a, slo, engine, cluster_cfg)}", file=sys.stderr, flush=True)
    run_loop(_serve(engine, cluster_cfg, settings, a.host, a.port, a.served_model_name, a.model, a.tui))
    return 0


async def _serve(engine, cluster_cfg, settings, host: str, port: int,
                 served_name: Optional[str], model_arg: str, tui: bool = False) -> None:
    from aserve.api.server import run_server
    from aserve.cluster.cluster import Cluster

    print(f"aserve: loading {model_arg} ...", file=sys.stderr, flush=True)
    cluster = Cluster(engine, cluster_cfg)
    # every instance steps once before the server listens: the first request is as fast as the tenth
    num = cluster_cfg.num_prefill + cluster_cfg.num_decode if cluster_cfg.split else cluster_cfg.num_coupled
    print(f"aserve: starting {num} instances, each warmed up by one prompt chunk and one decode step ...",
          file=sys.stderr, flush=True)
    await cluster.start(warm_up=True)
    print(f"aserve: kernels {_kernels_line(cluster.bundle.kernels, engine)}", file=sys.stderr, flush=True)
    if cluster.core_share.lender is not None:
        print(f"aserve: {cluster.core_share.lender.describe()}", file=sys.stderr, flush=True)
    if engine.device.startswith("cuda"):  # each instance's share of the card, and its graphs
        for line in cluster.device_lines():
            print(f"aserve: {line}", file=sys.stderr, flush=True)
    try:
        name = served_name or cluster.bundle.path.name
        await run_server(cluster, name, settings, host, port, aliases=(model_arg,), tui=tui,
                         on_stop=lambda: _exit_deadline(settings.shutdown_timeout_s + EXIT_DEADLINE_S),
                         notes=tuple(startup_notes(settings, host)))
    finally:
        await cluster.stop(wait_s=STOP_WAIT_S)


def _kernels_line(kernels: str, engine) -> str:
    """Which kernels the model runs on, and why torch's own ops when ours were wanted but do not
    build here (a machine without a C++ compiler with OpenMP, or without Python's headers)."""
    if kernels != "fallback" or engine.kernels != "auto" or engine.device != "cpu":
        return kernels
    from model import native

    return f"fallback (torch's own ops, slower: {native.why_unavailable()}; see the README on a fresh machine)"


def _exit_deadline(seconds: float) -> None:
    """The bounded exit's last resort, armed when the drain begins: a process still here
    ``seconds`` later (its drain is long over) leaves without waiting for busy threads."""
    def leave() -> None:
        print(f"aserve: shutdown overran {seconds:g} s; exiting without waiting for work still running on "
              "device threads", file=sys.stderr, flush=True)
        os._exit(EXIT_OVERRAN)

    timer = threading.Timer(seconds, leave)
    timer.daemon = True  # a normal exit does not wait for it
    timer.start()
