"""The engine and cluster flags every serving command shares, and the frozen configs they make.

Configs are built here, once, from the parsed flags, then passed down; nothing below reads flags
or the environment. A hardware-dependent setting left to its default (``--chunk-size``,
``--max-num-batched-tokens``, ``--placement-costs``) stays unset (None) here, and is measured in
one start-up step, ``aserve/devices/measured.resolve`` (which ``Cluster`` runs, and
``engine_and_cluster`` for a command that prints the settings first); the module doc says how.
What the SLO in force sets (the token budgets it sizes, SLO placement) is aserve/commands/slo_budget.py.
"""
from __future__ import annotations

import argparse
import json
from typing import Optional

from aserve.commands.slo_budget import (engine_tbt, prefill_tbt_arg, slo_cluster, step_limit_arg, step_limits,
                                        tbt_slo_arg)


def add_switches(g, table) -> None:
    """On/off flags (``--x`` / ``--no-x``), one ``(flag, default, help)`` row each, added in the
    table's order (the order ``--help`` lists them in)."""
    for flag, default, what in table:
        g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=what)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct, bundled), a local HF checkpoint folder, or a .gguf file")
    g.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 | fp32 (auto: bf16 on CUDA and AMX/AVX512-BF16 CPUs)")
    g.add_argument("--device", default="cpu",
                   help="cpu | cuda | cuda:i | sim:PROFILE (a simulated device on virtual time: sim:opt-13b-v100-32gb, "
                        "sim:local = this machine's measured engine, or sim:FILE.json)")
    g.add_argument("--attention", default="auto",
                   help="attention backend: auto | reference | sdpa | native | flash (auto: native on CPU, flash or sdpa on CUDA)")
    g.add_argument("--kernels", default="auto",
                   help="aserve's C++ CPU kernels: auto (where they build) | native | unfused (ours, one call per op) "
                        "| fallback (torch's own ops only; attention auto -> sdpa)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size per instance, GiB")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: sarathi, alise: the largest meeting --tbt-slo on this "
                        "machine's measured engine, or the one 'aserve profile token-budget' saved; vllm: the "
                        "model's context length)")
    g.add_argument("--tbt-slo", type=tbt_slo_arg, default=None, metavar="gap|tpot|device|SECONDS",
                   help="the longest step, seconds, the token budget is sized for (Sarathi-Serve's rule: 32 decodes "
                        "beside a chunk at the workload's longest context), from the SLO in force (--slo): gap = its "
                        "token-gap limit (a step is a token's gap; else TPOT), tpot = the smaller of its TPOT and gap "
                        "limits (every step within the mean); device = 5x a 32-decode step (Sarathi-Serve's strict "
                        "SLO, the rule without an SLO). Default: gap for a chunked system (sarathi, alise, adaptive) "
                        "where an SLO is in force (serve: always), else device")
    g.add_argument("--step-budget", default=None, metavar="fixed|sized",
                   help="sarathi: fixed = every step within the token budget; sized = a step's prompts may take "
                        "what its decodes, at their contexts, leave of the step time the budget is sized for (the "
                        "budget a floor). Default: sized for serve where --max-num-batched-tokens is not given, "
                        "else fixed")
    g.add_argument("--step-limit", type=step_limit_arg, default=None, metavar="tpot|gap|SECONDS",
                   help="--step-budget sized: the step time a step's prompts fill, from the SLO in force (gap = "
                        "its token-gap limit; tpot = the smaller of its TPOT and token-gap limits, and a step with "
                        "no decodes its token gap) or seconds. Default: tpot where an SLO is in force, else the "
                        "token budget's own step time")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests in one batch at most")
    g.add_argument("--batching", default="sarathi", help="coupled batching policy: sarathi | vllm | alise")
    g.add_argument("--swap-gb", type=float, default=0.25, help="host swap space for preempted KV, GiB")
    g.add_argument("--swap-dtype", default="same",
                   help="how swapped KV is stored: same (the model dtype) | int8 (channel-wise scales, ALISE Eq. 8)")
    g.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = all cores)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (default: decode steps replay CUDA graphs captured at start-up, "
                        "one per batch and context bucket)")
    g.add_argument("--fused-step", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: decode steps of up to 16 rows are captured over the fused Triton step (five kernels a "
                        "layer, LLaMA family in bf16/fp16) instead of torch's ops (default: on where it applies)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching: full KV blocks stay cached after their requests end and a prompt "
                        "starts on the longest cached chain of its blocks (same cache_salt only); evicted least "
                        "recently used when the pool needs room (default: on, as vLLM v1)")
    g.add_argument("--allow-profile-mismatch", action="store_true",
                   help="use a measured profile (sim:FILE.json, from 'aserve profile device --out') even where it was "
                        "measured for another engine than the simulated instances' (threads each, dtype, attention, "
                        "kernels, model), with a warning; without it such a profile is refused with the command "
                        "that measures the right one")
    g.add_argument("--cache-dir", default=None, help="where the dequantised default model is cached")
    g.add_argument("--seed", type=int, default=0)


def add_cluster_args(p: argparse.ArgumentParser, default_mode: str = "disagg") -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--mode", default=default_mode,
                   help="disagg (prefill and decode instances) | coupled | adaptive (--prefill N --decode M to "
                        "start; every instance also prefills in budgeted chunks, prompts go where they cost least)"
                   + (" | offline (no cluster)" if default_mode == "offline" else "") + f" (default: {default_mode})")
    g.add_argument("--prefill", type=int, default=1, help="prefill instances (disagg)")
    g.add_argument("--decode", type=int, default=1, help="decode instances (disagg)")
    g.add_argument("--instances", type=int, default=2, help="coupled instances (coupled)")
    g.add_argument("--prefill-policy", default="fcfs", help="fcfs | sjf | ljf")
    g.add_argument("--prefill-sched-batch", type=int, default=16)
    g.add_argument("--chunk-size", type=int, default=None,
                   help="fixed prefill chunk, tokens (default: the smallest chunk within 10%% of the best prefill "
                        "tokens/s on this machine's measured engine, at the instances' threads)")
    g.add_argument("--pad", action="store_true",
                   help="disagg: pad a chunk the queue cannot fill up to the chunk size (the paper's fixed-size "
                        "chunks; off by default: pad rows cost compute like real ones and buy nothing)")
    g.add_argument("--no-pad", action="store_true", help="no padding (the default; kept for old command lines)")
    g.add_argument("--dispatch", default="interference",
                   help="interference | random | round-robin | least-loaded | imbalance")
    g.add_argument("--decode-policy", default="greedy", help="greedy | reserve-static | reserve-dynamic")
    g.add_argument("--preemption", default="recompute", help="recompute | swap")
    g.add_argument("--predictor", default=None,
                   help="output-length predictor: none | oracle | sklearn | lm | retrieval | accuracy (a simulation's: "
                        "the true bucket at --predictor-option accuracy=P; predictors/README.md). Default: what serve "
                        "runs (sklearn; no true length for an API request), on a sim: device accuracy at sklearn's "
                        "measured 65.7%% (aserve/commands/serve_predictor.py); oracle only when asked for")
    g.add_argument("--predictor-granularity", type=int, default=200,
                   help="length bucket width, tokens: 100 | 200 | 400")
    g.add_argument("--predictor-mode", default="parallel",
                   help="parallel: beside the prefill, awaited at the KV handoff | "
                        "sequential: before the prefill (adds to TTFT)")
    g.add_argument("--predictor-features", default="auto",
                   help="auto | prefill | prompt: where a predictor whose backbone is the served model (lm) "
                        "gets its features: the request's own prefill (auto: where it can, disagg + parallel) "
                        "or its own pass over the prompt")
    g.add_argument("--predictor-timeout", type=float, default=0.5,
                   help="seconds a prediction may take; past them the request goes on without one (counted)")
    g.add_argument("--predictor-cover", type=float, default=None, metavar="Q",
                   help="answer the lowest length bucket the predictor's scores say holds the output with "
                        "probability Q (0 < Q <= 1), not the most likely one: reservations then run short less "
                        "often (default: the most likely bucket)")
    g.add_argument("--predictor-option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option, repeatable, JSON values (e.g. device=cuda, classifier=logreg)")
    g.add_argument("--predictor-path", default=None,
                   help="a saved predictor folder (default: the artefact 'aserve predictor train' caches, else fit one)")
    g.add_argument("--predictor-labels", default=None,
                   help="labels to fit on when no artefact exists (default: the committed set)")
    g.add_argument("--predictor-prompts", default=None,
                   help="the prompts those labels refer to (default: the shared pool)")
    g.add_argument("--link", default="nvlink", help="nvlink | roce | pcie | bw=25GB/s,latency=5us")
    g.add_argument("--emulate-model", default=None, help="charge the link for this model's KV size (e.g. opt-13b)")
    g.add_argument("--emulate-kv-bytes-per-token", type=int, default=None)
    g.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between load broadcasts")
    g.add_argument("--flip", default="off", help="instance flips: off | idle | ratio (disagg)")
    g.add_argument("--flip-window", type=float, default=10.0, help="ratio flips: seconds of measured work")
    g.add_argument("--flip-idle", type=float, default=60.0, help="idle flips: seconds an instance must be idle")
    for flag, default, what in (
            ("--flip-band", 0.1, "ratio flips: hysteresis, the share of the cluster the prefill work share must pass "
                                 "a split's midpoint by before an instance moves"),
            ("--flip-dwell", 0.0, "ratio flips: seconds an instance keeps a role before it may flip again "
                                  "(0: --flip-window)"),
            ("--flip-cooldown", 0.0, "ratio flips: seconds between two flips anywhere (0: --flip-window)"),
            ("--interference", 0.2, "adaptive placement: weight of the running decodes' slowdown against a "
                                    "prompt's own wait (scheduling/placement.py; tuned on the synthetic workloads "
                                    "and the Azure conversation trace only)")):
        g.add_argument(flag, type=float, default=default, help=what)
    g.add_argument("--keep-margin", type=keep_margin_arg, default=None, metavar="auto|N",
                   help="adaptive placement: whether a prefill instance keeps a request it prefilled and decodes it; "
                        "auto (default): unless a hand-over saves more than it costs, priced with the measured step "
                        "costs; N: unless it runs N decodes more than the least busy decode instance "
                        "(scheduling/placement.py)")
    add_switches(g, (
        ("--prompt-first", False, "adaptive: a prompt that ends within the budget its instance's decodes leave runs "
                                  "first, in a step of its own (vLLM's prompt step), instead of sharing its last step "
                                  "with the decodes; their token gap stays within one full step's (scheduling/hybrid.py)"),
        ("--prefix-aware-placement", True, "with prefix caching: a prompt goes where its cached prefix saves more than "
                                           "the queue there costs (coupled, disagg: the least uncached work; adaptive: "
                                           "the placement's priced cost), instead of by load alone "
                                           "(scheduling/placement.py)"),
        ("--rebalance", True, "adaptive: once requests stop arriving and no prompt is queued anywhere, running decodes "
                              "move from the busiest instance to the least busy one (an idle prefill instance "
                              "included) by KV migration, as many as pay by the placement's step costs "
                              "(scheduling/placement.py)")))
    g.add_argument("--rebalance-quiet", type=float, default=10.0, metavar="S",
                   help="adaptive rebalance: decodes move only once no request has arrived for S seconds (while "
                        "requests keep coming the placement evens the load, and moves cost)")
    g.add_argument("--kv-relief", type=kv_relief_arg, default=16, metavar="BLOCKS|off",
                   help="adaptive: an instance whose running decodes will want more KV blocks within their next "
                        "few tokens than it has free moves its decode with the longest predicted rest, by KV "
                        "migration, to the instance with the most spare blocks, if that one keeps BLOCKS spare "
                        "beyond it; one move at a time, while requests arrive too (a move instead of a "
                        "preemption). 'off': preempt instead. Default: 16")
    g.add_argument("--placement-costs", type=placement_costs_arg, default=None, metavar="STEP_S,TOKEN_S,ROW_S",
                   help="adaptive: the step costs placement prices with (a step's fixed seconds, a prompt token's, a "
                        "decode row's) instead of deriving them from the measured engine (or sim: profile): to "
                        "replay on sim: the choices a real run made (its report's config has them)")
    g.add_argument("--prefill-tbt-slo", type=prefill_tbt_arg, default=None, metavar="gap|tpot|same|SECONDS",
                   help="adaptive: the longest step the prefill-role instances' own token budget is sized for "
                        "(TaiChi's prefill-heavy instances: few decodes ride there; a step with none runs its prompts "
                        "whole): gap, tpot, SECONDS as --tbt-slo; same = the engine's budget. Default: gap where the "
                        "engine's budget is sized for the SLO, else same")
    add_switches(g, (
        ("--slo-placement", None, "adaptive: place each prompt, among the instances where its estimated TTFT keeps "
                                  "--slo-slack of the SLO's TTFT limit, where its chunks slow the fewest running "
                                  "decodes (else where it costs least), and late-bind by the same rule "
                                  "(scheduling/placement.py). Default: on wherever the SLO in force has a TTFT limit "
                                  "(serve: always), else off"),
        ("--tpot-placement", None, "adaptive: place and late-bind each prompt first among the instances where its "
                                   "chunks push the fewest running decodes past the SLO's TPOT limit, each decode's "
                                   "room priced from its time so far and its predicted length "
                                   "(scheduling/placement.py). Default: on wherever the SLO in force has a TPOT limit "
                                   "(serve: always), else off"),
        ("--slo-order", False, "adaptive: each instance admits waiting prompts by TTFT deadline (arrival + the SLO's "
                               "TTFT limit) and gives each step's prompt rows to its admitted prompts in that order "
                               "(earliest deadline first, a chunk at a time), those already past theirs after those "
                               "that can still meet it; requests already started (preempted, handed over) first as "
                               "before (scheduling/hybrid.py)")))
    g.add_argument("--slo-slack", type=float, default=0.5,
                   help="--slo-placement: the share of a prompt's TTFT limit its estimated TTFT may use")
    g.add_argument("--no-flip-migrate", action="store_true",
                   help="adaptive: a decode instance turning prefill keeps its decodes instead of moving them out "
                        "by KV migration")
    g.add_argument("--on-failure", default="rerun", help="a failed instance's requests: rerun | error")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds before a KV transfer is retried")
    g.add_argument("--transfer-retries", type=int, default=2,
                   help="a failed or timed-out KV transfer is tried again on another decode instance this many times")
    g.add_argument("--on-transfer-failure", default="recompute",
                   help="a KV hand-over that cannot happen (retries spent, or --lease ran out): recompute "
                        "(re-run from the prompt) | fail (end the request with a readable error)")
    g.add_argument("--lease", type=float, default=60.0,
                   help="seconds KV may be held for a hand-over that has not happened: decode blocks reserved "
                        "for KV that never came are freed; prefilled KV no decode instance had room for is released")
    g.add_argument("--cluster", dest="backend", default="local", metavar="local|ray[:ADDRESS]",
                   help="where instances run: local (threads of this process) | ray (one Ray actor each, a local Ray "
                        "sized to this machine) | ray:ADDRESS (join the Ray cluster at ADDRESS, or ray:auto; docs/RAY.md)")
    g.add_argument("--actor-start-timeout", type=float, default=300.0,
                   help="--cluster ray: seconds an instance's actor may take to start and load the model")
    g.add_argument("--ray-kv", default="direct", metavar="direct|socket|object-store",
                   help="--cluster ray: KV hand-overs go actor to actor (direct: through shared memory between "
                        "actors on one host, over a socket of their own between hosts), over the socket always "
                        "(socket), or through Ray's object store (docs/RAY.md)")
    g.add_argument("--ray-placement", default="auto", metavar="auto|pools|spread|pack",
                   help="--cluster ray: auto (Ray's scheduler) | pools (a placement group per role, PACK) | "
                        "spread | pack (one group over every instance); hosts marked aserve_ROLE take that role")
    g.add_argument("--device-share", default="shared", metavar="shared|lend|dedicated",
                   help="shared: instances share the CPU's cores, cores/N threads each | lend: as shared, and an "
                        "idle instance's threads join a busy one's steps (serve's default) | dedicated: emulate one device per "
                        "instance (cores/N of a core each, an idle instance's share is lost), as on GPUs")


def engine_and_cluster(a: argparse.Namespace, context: Optional[int] = None, slo=None):
    """The command line's engine and cluster, with the measured defaults resolved in one start-up
    step (aserve/devices/measured.py; the device's profile is measured here if never before);
    ``slo`` (an ``aserve.replay.slo.Slo``): the SLO in force, which sizes the token budgets
    (``--tbt-slo``, ``--prefill-tbt-slo``)."""
    from aserve.devices.measured import resolve

    engine = engine_config(a, context, slo=slo)
    return resolve(engine, slo_cluster(a, slo, context, engine, cluster_config(a)))


def instance_threads(a: argparse.Namespace) -> int:
    """Torch threads each instance of ``a``'s cluster gets (aserve/devices/measured.py)."""
    from aserve.devices.measured import threads_each

    mode = getattr(a, "mode", "offline")
    num = 1 if mode == "offline" else (a.prefill + a.decode if mode in ("disagg", "adaptive") else a.instances)
    return threads_each(a.threads or 0, num)


def bundle_engine(a: argparse.Namespace):
    """The engine fields that decide the loaded model (and what a profile measures), nothing derived."""
    from aserve.config import EngineConfig

    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, attention=a.attention, kernels=a.kernels,
                        block_size=a.block_size, cache_dir=a.cache_dir,
                        allow_profile_mismatch=a.allow_profile_mismatch)


def keep_margin_arg(text: str) -> Optional[int]:
    """``--keep-margin``: ``auto`` (None: priced) or a whole number of decodes >= 0."""
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected auto or a whole number >= 0, got {text!r}")
    return int(text)


def kv_relief_arg(text: str) -> Optional[int]:
    """``--kv-relief``: blocks >= 0, or 'off' (None: no moves against KV pressure)."""
    if text.strip().lower() == "off":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of blocks >= 0 or 'off', got {text!r}")
    return value


def placement_costs_arg(text: str) -> tuple[float, float, float]:
    """``--placement-costs``: three seconds >= 0, comma-separated."""
    parts = text.split(",")
    try:
        values = tuple(float(x) for x in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or not all(0 <= v < float("inf") for v in values):  # NaN fails the comparison too
        raise argparse.ArgumentTypeError(f"expected STEP_S,TOKEN_S,ROW_S (three seconds >= 0), got {text!r}")
    return values


def placement_costs(a: argparse.Namespace) -> dict:
    """``--placement-costs`` as the three config fields; unset, None each: measured at start-up."""
    step, token, row = a.placement_costs if a.placement_costs is not None else (None, None, None)
    return {"placement_step_s": step, "placement_prefill_token_s": token, "placement_decode_row_s": row}


def cluster_config(a: argparse.Namespace):
    from aserve.config import ClusterConfig

    from aserve.commands.serve_predictor import default_predictor

    options = parse_options(a.predictor_option, "predictor-option")  # a bad flag errs before any profiling
    predictor, options, _ = default_predictor(a, options)  # --predictor, else serve's (a sim's: set accuracy)
    return ClusterConfig(mode=a.mode, num_prefill=a.prefill, num_decode=a.decode, num_coupled=a.instances,
                         prefill_policy=a.prefill_policy, prefill_sched_batch=a.prefill_sched_batch,
                         chunk_size=a.chunk_size, pad=a.pad and not a.no_pad, dispatch=a.dispatch, decode_policy=a.decode_policy,
                         preemption=a.preemption, predictor=predictor, predictor_granularity=a.predictor_granularity,
                         predictor_mode=a.predictor_mode, predictor_timeout_s=a.predictor_timeout,
                         predictor_cover=a.predictor_cover, predictor_features=a.predictor_features,
                         predictor_options=options,
                         predictor_path=a.predictor_path, predictor_labels=a.predictor_labels,
                         predictor_prompts=a.predictor_prompts, link=a.link, emulate_model=a.emulate_model,
                         emulate_kv_bytes_per_token=a.emulate_kv_bytes_per_token,
                         monitor_interval_s=a.monitor_interval, flip=a.flip, flip_window_s=a.flip_window,
                         flip_idle_s=a.flip_idle, flip_band=a.flip_band, flip_dwell_s=a.flip_dwell,
                         flip_cooldown_s=a.flip_cooldown, flip_migrate=not a.no_flip_migrate,
                         interference=a.interference, keep_margin=a.keep_margin, prompt_first=a.prompt_first,
                         rebalance=a.rebalance, rebalance_quiet_s=a.rebalance_quiet, kv_relief=a.kv_relief,
                         prefix_aware_placement=a.prefix_aware_placement,
                         **placement_costs(a),
                         on_failure=a.on_failure,
                         transfer_timeout_s=a.transfer_timeout,
                         transfer_retries=a.transfer_retries, on_transfer_failure=a.on_transfer_failure,
                         lease_s=a.lease, device_share=a.device_share, backend=a.backend,
                         actor_start_timeout_s=a.actor_start_timeout, ray_kv=a.ray_kv,
                         ray_placement=a.ray_placement, seed=a.seed)


def engine_config(a: argparse.Namespace, context: Optional[int] = None, derive: bool = True, slo=None):
    """The command line's engine; an unset token budget is left to be measured at start-up
    (``context``: the longest prompt + output the workload reaches, which replays know; the budget
    holds its SLO there, default the model's context window; ``slo``: the SLO in force, which
    ``--tbt-slo``'s default sizes it for). ``derive=False`` (the engine benchmarks, which time
    fixed shapes) leaves an unset budget at 512 unmeasured."""
    from aserve.config import EngineConfig
    from aserve.profiles.profile_store import DEFAULT_TOKEN_BUDGET

    budget = a.max_num_batched_tokens
    if budget is None and not derive:
        budget = DEFAULT_TOKEN_BUDGET
    tbt = engine_tbt(a, slo, context) if budget is None else (a.tbt_slo if isinstance(a.tbt_slo, float) else None)
    sized = step_budget(a)
    limit, alone = step_limits(a, slo, context) if sized == "sized" else (None, None)
    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, attention=a.attention, kernels=a.kernels,
                        block_size=a.block_size,
                        kv_cache_gb=a.kv_cache_gb, max_num_batched_tokens=budget, tbt_slo=tbt,
                        budget_context=context, step_budget=sized,
                        step_limit_s=limit, step_limit_alone_s=alone,
                        max_num_seqs=a.max_num_seqs, batching=a.batching, swap_gb=a.swap_gb,
                        swap_dtype=a.swap_dtype, num_threads=a.threads, enforce_eager=a.enforce_eager, fused_step=a.fused_step,
                        enable_prefix_caching=a.enable_prefix_caching, cache_dir=a.cache_dir, seed=a.seed,
                        allow_profile_mismatch=a.allow_profile_mismatch)


def step_budget(a: argparse.Namespace) -> str:
    """``--step-budget``, or its default: sized where the command sizes steps by default (serve,
    ``a.sized_steps``) and no ``--max-num-batched-tokens`` fixes the budget, else fixed."""
    if a.step_budget:
        return a.step_budget
    return "sized" if getattr(a, "sized_steps", False) and a.max_num_batched_tokens is None else "fixed"


def parse_options(items: list[str], field: str = "option") -> dict:
    """``["k=3", "pooling=last"]`` -> ``{"k": 3, "pooling": "last"}`` (values read as JSON when they parse)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"field {field!r}: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def sampling_from(a: argparse.Namespace):
    from scheduling.request import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          seed=a.seed if a.temperature > 0 else None, stop=tuple(a.stop), ignore_eos=a.ignore_eos)
