"""Frozen configs, built once in ``cli.py`` and passed down."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from model.attention import BACKENDS
from model.kv_cache import SWAP_DTYPES
from model.native import KERNELS
from scheduling import registry


STEP_BUDGETS = ("fixed", "sized")  # EngineConfig.step_budget


@dataclass(frozen=True)
class EngineConfig:
    """What one instance's engine needs: the model, its dtype and device, the KV pool, batching."""

    model: str = "default"
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32
    device: str = "cpu"  # cpu | cuda[:i] | sim:PROFILE (a simulated device: aserve/devices/sim_device.py)
    attention: str = "auto"  # auto: native on CPUs where our kernels build, else sdpa; flash on CUDA when installed
    # our C++ kernels (model/native.py): auto (native where they build) | native | unfused (ours, one call
    # per op: A/B measurements) | fallback (torch's own ops only; attention auto -> sdpa)
    kernels: str = "auto"
    block_size: int = 16
    kv_cache_gb: float = 1.0
    # None: measured at start-up (aserve/devices/measured.py): vllm the context window, else the
    # Sarathi-Serve budget for tbt_slo at budget_context
    max_num_batched_tokens: Optional[int] = 512
    tbt_slo: Optional[float] = None  # seconds a step may take, the measured budget's SLO (None: 5x a decode step)
    budget_context: Optional[int] = None  # context the measured budget holds its SLO at (None: the model's)
    # sarathi: fixed (every step within the budget) | sized (a step's prompts may take what its decodes,
    # at their contexts, leave of the step time the budget was sized for: scheduling/coupled.py StepRoom)
    step_budget: str = "fixed"
    step_limit_s: Optional[float] = None  # sized: the step time a step's prompts fill (None: tbt_slo's)
    step_limit_alone_s: Optional[float] = None  # sized: the same for a step with no decodes (None: step_limit_s)
    max_num_seqs: int = 256
    batching: str = "sarathi"  # coupled policy: sarathi | vllm | alise
    swap_gb: float = 0.25  # host swap space for preempted KV (alise, decode swap)
    swap_dtype: str = "same"  # how swapped KV is stored: same (the model dtype) | int8 (ALISE Eq. 8)
    num_threads: int = 0  # torch threads on CPU; 0 = every core
    # CUDA: True runs every step eagerly; False replays decode steps as CUDA graphs captured at start
    # (aserve/devices/cuda_graphs.py; vLLM's flag of the same name)
    enforce_eager: bool = False
    # CUDA graphs of up to 16 decode rows capture the fused Triton step (model/fused_step.py: five
    # kernels a layer) where the model takes it, instead of torch's ops
    fused_step: bool = True
    # automatic prefix caching (scheduling/prefix.py, vLLM's flag): full KV blocks are kept after
    # their requests end, found by content (and cache_salt) and shared; evicted least recently used
    enable_prefix_caching: bool = True
    # a measured sim: profile of another engine (threads, dtype, attention, kernels, model than the
    # simulated instances') is refused; True: used with a warning (aserve/profiles/profile_check.py)
    allow_profile_mismatch: bool = False
    cache_dir: Optional[str] = None
    seed: int = 0

    def __post_init__(self):
        if self.attention != "auto" and self.attention not in BACKENDS:
            raise ValueError(f"bad attention backend {self.attention!r}: choose one of auto, {', '.join(BACKENDS)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"bad kernels {self.kernels!r}: choose one of {', '.join(KERNELS)}")
        if self.kernels == "fallback" and self.attention == "native":
            raise ValueError("attention 'native' is one of aserve's C++ kernels, which kernels 'fallback' turns off")
        if self.batching not in registry.names("batching"):
            raise ValueError(f"bad batching policy {self.batching!r}: choose one of {', '.join(registry.names('batching'))}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.swap_gb < 0:
            raise ValueError(f"swap_gb must be >= 0, got {self.swap_gb}")
        if self.swap_dtype not in SWAP_DTYPES:
            raise ValueError(f"bad swap_dtype {self.swap_dtype!r}: choose one of {', '.join(SWAP_DTYPES)}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1) or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.tbt_slo is not None and not self.tbt_slo > 0:
            raise ValueError(f"--tbt-slo must be > 0 seconds, got {self.tbt_slo}")
        if self.step_limit_s is not None and not self.step_limit_s > 0:
            raise ValueError(f"--step-limit must be > 0 seconds, got {self.step_limit_s}")
        if self.step_limit_alone_s is not None and not self.step_limit_alone_s > 0:
            raise ValueError(f"step_limit_alone_s must be > 0 seconds, got {self.step_limit_alone_s}")
        if self.step_budget not in STEP_BUDGETS:
            raise ValueError(f"bad step_budget {self.step_budget!r}: choose one of {', '.join(STEP_BUDGETS)}")
        if not (self.device == "cpu" or self.device.startswith("cuda") or self.device.startswith("sim:")):
            raise ValueError(f"bad device {self.device!r}: cpu, cuda[:i] or sim:PROFILE")


MODES = ("disagg", "coupled", "adaptive")
DEVICE_BACKENDS = ("local", "ray")  # where instances run (ClusterConfig.backend)
RAY_KV_TRANSPORTS = ("direct", "socket", "object-store")  # how KV goes between Ray actors (aserve/devices/kv_wire.py)
RAY_PLACEMENTS = ("auto", "pools", "spread", "pack")  # aserve/devices/ray_placement.py
TRANSFER_FAILURE_POLICIES = ("recompute", "fail")
DEVICE_SHARES = ("shared", "lend", "dedicated")
PREDICTOR_FEATURES = ("auto", "prefill", "prompt")


@dataclass(frozen=True)
class ClusterConfig:
    """The instances and the policies between them (TetriInfer's knobs and the baselines')."""

    mode: str = "disagg"  # disagg | coupled | adaptive (prefill and decode roles over hybrid schedulers)
    num_prefill: int = 1
    num_decode: int = 1
    num_coupled: int = 2
    # prefill instances
    prefill_policy: str = "fcfs"  # fcfs | sjf | ljf
    prefill_sched_batch: int = 16
    chunk_size: Optional[int] = 512  # None: the measured saturate chunk (aserve/devices/measured.py)
    pad: bool = True
    # dispatch and decode instances
    dispatch: str = "interference"
    decode_policy: str = "greedy"  # greedy | reserve-static | reserve-dynamic
    preemption: str = "recompute"  # recompute | swap (swap space: EngineConfig.swap_gb)
    heavy_threshold: int = 128
    # length predictor (aserve/predict/online.py; backends in predictors/)
    predictor: str = "oracle"  # none | oracle | sklearn | lm | retrieval | accuracy (simulations)
    predictor_granularity: int = 200  # bucket width, tokens: 100 | 200 | 400
    predictor_mode: str = "parallel"  # parallel: beside the prefill | sequential: before it (adds to TTFT)
    predictor_timeout_s: float = 0.5  # a prediction not ready by then: the request goes on without one
    # None: the predictor names its most likely bucket | q in (0, 1]: the lowest bucket its scores say the
    # length stays in with probability q (predictors.base.pick): a reservation then holds enough room more often
    predictor_cover: Optional[float] = None
    # auto: a predictor whose backbone is the served model's first layers (lm) reads them from the
    # request's own prefill where it can (disagg, parallel; the prompt as it was trained on) | prefill:
    # the same, an error where it cannot | prompt: always runs its backbone on the prompt itself
    predictor_features: str = "auto"
    predictor_options: tuple = ()  # backend keyword arguments, (key, value) pairs (a dict is accepted)
    predictor_path: Optional[str] = None  # a saved predictor folder; default: the cached artefact, or fit one
    predictor_labels: Optional[str] = None  # labels to fit on when no artefact exists (default: the committed set)
    predictor_prompts: Optional[str] = None  # the prompts those labels refer to (default: the shared pool)
    # interconnect
    link: str = "nvlink"
    emulate_model: Optional[str] = None
    emulate_kv_bytes_per_token: Optional[int] = None
    # control plane
    monitor_interval_s: float = 0.1
    flip: str = "off"  # off | idle | ratio (scheduling/flip.py)
    flip_window_s: float = 10.0  # ratio: the sliding window of measured work
    flip_idle_s: float = 60.0  # idle: how long an instance must be idle (the paper: a minute)
    flip_check_s: float = 0.25  # how often the transition watcher asks the policy
    flip_band: float = 0.1  # ratio: hysteresis, the work share must pass the split by this much to flip
    flip_dwell_s: float = 0.0  # ratio: an instance keeps a role at least this long (0: the window)
    flip_cooldown_s: float = 0.0  # ratio: seconds between two flips anywhere (0: the window)
    flip_migrate: bool = True  # adaptive: a decode instance turning prefill moves its decodes out by KV
    # adaptive mode's placement (scheduling/placement.py): step costs, None: from the measured device
    # at start-up (aserve/devices/measured.py)
    placement_step_s: Optional[float] = 0.01  # fixed seconds of a step
    placement_prefill_token_s: Optional[float] = 1e-3  # seconds a prompt token adds to a step
    placement_decode_row_s: Optional[float] = 1e-3  # seconds a decode row adds to a step
    interference: float = 0.2  # weight of running decodes' slowdown against a prompt's wait
    # adaptive: prefill-role instances' own token budget (TaiChi's prefill-heavy instances: their
    # decodes are few, so their steps may be as long as the token gap allows). None: the engine's
    # budget. prefill_tbt_slo: the step seconds it is sized for at start-up (aserve/devices/measured.py)
    prefill_token_budget: Optional[int] = None
    prefill_tbt_slo: Optional[float] = None
    # adaptive: the TTFT SLO in force as (seconds, a, b): limit = seconds + a x prefill + b x step, which
    # slo_placement places by (a prompt goes where its TTFT keeps placement_slack of the limit with the
    # least harm; scheduling/placement.py) and slo_order queues by (each instance admits prompts and gives
    # each step's prompt rows by TTFT deadline, those past it last; scheduling/hybrid.py)
    ttft_slo: Optional[tuple] = None
    slo_placement: bool = False
    slo_order: bool = False
    placement_slack: float = 0.5
    # adaptive: the TPOT SLO in force as (seconds, c): limit = seconds + c x a batch-1 decode step; placement
    # then keeps prompts from instances where their chunks would push running decodes past it
    # (scheduling/placement.py, tpot_misses); None: placed without regard to TPOT
    tpot_slo: Optional[tuple] = None
    keep_margin: Optional[int] = None  # None: keep unless a hand-over pays (priced); N: unless it decodes N more
    prompt_first: bool = False  # adaptive: prompts that end within the budget run in a step of their own
    # with prefix caching: placement counts each instance's cached prefix of the prompt (scheduling/placement.py)
    prefix_aware_placement: bool = True
    rebalance: bool = True  # adaptive: with no prompt queued, decodes move to the least busy instance by KV
    rebalance_quiet_s: float = 10.0  # ... only once no request has arrived for this long
    # adaptive: an instance whose running decodes will want more blocks within a few tokens than it
    # has free moves one to the instance with the most spare blocks, which keeps this many spare
    # beyond it; None: never (a preemption instead)
    kv_relief: Optional[int] = 16
    on_failure: str = "rerun"  # rerun | error: what happens to a failed instance's requests
    transfer_timeout_s: float = 30.0  # a KV transfer slower than this is retried elsewhere
    transfer_retries: int = 2  # retries on other decode instances before on_transfer_failure applies
    # a KV hand-over that cannot happen (retries spent, or the lease below ran out): recompute (re-run
    # from the prompt, keeping the tokens streamed) | fail (end the request with an error it can read)
    on_transfer_failure: str = "recompute"
    # KV held for a hand-over that has not happened is let go after this: decode blocks reserved for
    # KV that never arrives are freed, and prefilled KV no decode instance has had room for is
    # released (then on_transfer_failure applies)
    lease_s: float = 60.0
    # shared | lend: an idle instance's cores go to busy ones' steps (aserve/devices/cores.py) | dedicated:
    # emulate one device per instance (aserve/devices/device.py, CoreShare)
    device_share: str = "shared"
    # where instances' devices live: local (threads of this process) | ray (a Ray actor each, on a
    # local Ray sized to this machine) | ray:ADDRESS (on the running Ray cluster at ADDRESS, or auto)
    backend: str = "local"
    actor_start_timeout_s: float = 300.0  # ray: an actor not up (model loaded) by then fails its instance
    ray_kv: str = "direct"  # ray: KV actor to actor (shared memory on one host, else a socket), socket always, or object-store (aserve/devices/kv_wire.py)
    ray_placement: str = "auto"  # ray: auto | pools | spread | pack (aserve/devices/ray_placement.py)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"bad mode {self.mode!r}: choose one of {', '.join(MODES)}")
        counts = (self.num_prefill, self.num_decode) if self.split else (self.num_coupled,)
        if min(counts) < 1:
            raise ValueError(f"{self.mode} mode needs at least one instance of each kind, got {counts}")
        for value, kind, field in ((self.prefill_policy, "prefill", "prefill_policy"), (self.dispatch, "dispatch", "dispatch"),
                                   (self.decode_policy, "decode", "decode_policy"), (self.flip, "flip", "flip")):
            if value not in registry.names(kind):
                what = "flip policy" if kind == "flip" else field
                raise ValueError(f"bad {what} {value!r}: choose one of {', '.join(registry.names(kind))}")
        if self.preemption not in ("recompute", "swap"):
            raise ValueError(f"bad preemption {self.preemption!r}: recompute or swap")
        if (self.chunk_size is not None and self.chunk_size < 1) or self.prefill_sched_batch < 1:
            raise ValueError("chunk_size and prefill_sched_batch must be >= 1")
        self._check_predictor()
        if self.monitor_interval_s <= 0:
            raise ValueError("monitor_interval_s must be > 0")
        if self.on_failure not in ("rerun", "error"):
            raise ValueError(f"bad on_failure {self.on_failure!r}: rerun or error")
        if self.on_transfer_failure not in TRANSFER_FAILURE_POLICIES:
            raise ValueError(f"bad on_transfer_failure {self.on_transfer_failure!r}: "
                             f"{' or '.join(TRANSFER_FAILURE_POLICIES)}")
        for name in ("flip_window_s", "flip_idle_s", "flip_check_s", "transfer_timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("flip_band", "flip_dwell_s", "flip_cooldown_s", "placement_step_s", "placement_prefill_token_s",
                     "placement_decode_row_s", "interference"):
            if getattr(self, name) is None and name.startswith("placement_"):
                continue  # measured at start-up
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.device_share not in DEVICE_SHARES:
            raise ValueError(f"bad device_share {self.device_share!r}: {', '.join(DEVICE_SHARES)}")
        if self.transfer_retries < 0:
            raise ValueError(f"transfer_retries must be >= 0, got {self.transfer_retries}")
        if self.rebalance_quiet_s < 0:
            raise ValueError(f"rebalance_quiet_s must be >= 0, got {self.rebalance_quiet_s}")
        if self.kv_relief is not None and self.kv_relief < 0:
            raise ValueError(f"kv_relief must be >= 0 blocks, got {self.kv_relief}")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {self.prefill_token_budget}")
        if self.prefill_tbt_slo is not None and not self.prefill_tbt_slo > 0:
            raise ValueError(f"--prefill-tbt-slo must be > 0 seconds, got {self.prefill_tbt_slo}")
        if (self.slo_placement or self.slo_order) and self.ttft_slo is None:
            raise ValueError("slo_placement and slo_order need the TTFT SLO in force (ttft_slo)")
        if not 0 < self.placement_slack <= 1:
            raise ValueError(f"--slo-slack must be in (0, 1], got {self.placement_slack}")
        if self.keep_margin is not None and self.keep_margin < 0:
            raise ValueError(f"keep_margin must be >= 0, got {self.keep_margin}")
        kind, sep, address = self.backend.partition(":")
        if kind not in DEVICE_BACKENDS or (sep and (kind != "ray" or not address.strip())):
            raise ValueError(f"bad backend {self.backend!r}: local, ray, or ray:ADDRESS")
        if kind == "ray" and self.device_share == "dedicated":
            raise ValueError("device_share 'dedicated' emulates one device per instance inside one process; with "
                             "backend ray every instance is a process of its own: use device_share 'shared'")
        if not self.actor_start_timeout_s > 0:
            raise ValueError(f"actor_start_timeout_s must be > 0, got {self.actor_start_timeout_s}")
        if self.ray_kv not in RAY_KV_TRANSPORTS:
            raise ValueError(f"bad ray_kv {self.ray_kv!r}: {' or '.join(RAY_KV_TRANSPORTS)}")
        if self.ray_placement not in RAY_PLACEMENTS:
            raise ValueError(f"bad ray_placement {self.ray_placement!r}: choose one of {', '.join(RAY_PLACEMENTS)}")

    @property
    def split(self) -> bool:
        """Prefill and decode roles (disagg, adaptive), not coupled instances."""
        return self.mode in ("disagg", "adaptive")

    @property
    def ray_address(self) -> Optional[str]:
        """The Ray cluster to join (``ray:ADDRESS``); None: start a local one (or use the Ray this
        process is already connected to)."""
        return self.backend.partition(":")[2].strip() or None

    def _check_predictor(self) -> None:
        from predictors.base import GRANULARITIES, MODES as PREDICTOR_MODES, check_cover
        from predictors.registry import BACKENDS, get_predictor

        if self.predictor not in BACKENDS:
            raise ValueError(f"bad predictor {self.predictor!r}: choose one of {', '.join(BACKENDS)}")
        if self.predictor_granularity not in GRANULARITIES:
            raise ValueError(f"bad predictor_granularity {self.predictor_granularity!r}: "
                             f"choose one of {', '.join(map(str, GRANULARITIES))}")
        if self.predictor_mode not in PREDICTOR_MODES:
            raise ValueError(f"bad predictor_mode {self.predictor_mode!r}: choose one of {', '.join(PREDICTOR_MODES)}")
        if self.predictor_features not in PREDICTOR_FEATURES:
            raise ValueError(f"bad predictor_features {self.predictor_features!r}: "
                             f"choose one of {', '.join(PREDICTOR_FEATURES)}")
        if self.predictor_features == "prefill" and not (self.mode == "disagg" and self.predictor_mode == "parallel"):
            raise ValueError("predictor_features 'prefill' needs mode 'disagg' and predictor_mode 'parallel': the "
                             "features come from the prefill, which the prediction must not wait for")
        if not self.predictor_timeout_s > 0:
            raise ValueError(f"predictor_timeout_s must be > 0, got {self.predictor_timeout_s}")
        check_cover(self.predictor_cover)
        try:
            options = dict(self.predictor_options)
        except (TypeError, ValueError):
            raise ValueError(f"predictor_options must be a dict or (key, value) pairs, "
                             f"got {self.predictor_options!r}") from None
        # frozen: normalise once, to sorted pairs
        object.__setattr__(self, "predictor_options", tuple(sorted(options.items(), key=lambda kv: kv[0])))
        for key, flag in (("granularity", "predictor_granularity"), ("max_length", "the label file")):
            if key in options:
                raise ValueError(f"predictor option {key!r} is set by {flag}, not by an option")
        if self.predictor == "none" and (options or self.predictor_path):
            raise ValueError("the 'none' predictor takes no options and no predictor_path")
        if options:  # unknown keys and bad values fail here, not minutes later in Cluster.start
            get_predictor(self.predictor, granularity=self.predictor_granularity, **options)
