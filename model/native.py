"""Our C++ CPU kernels, compiled on first use with torch's extension builder (about a minute,
cached under ~/.cache/torch_extensions/aserve), and skipped with a clear reason where no compiler is.

- ``paged_decode``: decode attention that reads K/V blocks in place (``model/csrc/paged_attention.cpp``,
  with a bf16 fast path in ``paged_decode_bf16.cpp``, 16 lanes at a time with AVX-512, 8 with AVX2);
- ``linear`` and ``silu_mul``: bf16 matrix products on CPUs with AVX512-BF16 over weights packed
  once, on first use, into the layout of ``model/csrc/gemm_bf16.cpp`` (faster than torch's
  matmul at every batch size measured, 1 to 512 rows, so every bf16 CPU linear goes there);
- ``linear``, ``logits`` and ``silu_mul`` of an fp32 model (a CPU without AVX512-BF16, where
  ``dtype auto`` is fp32): products over weights packed once into groups of 32 outputs with AVX2
  FMAs (``model/csrc/gemm_f32.cpp``, ``f32_packable``), and ``rms_norm`` and ``rope`` in one call
  each (``model/csrc/fp32_ops.cpp``): on a 2-core Zen 3 torch's fp32 product repacked each
  weight at every call;
- ``paged_prefill``: causal attention of prompt chunks over the pool, bf16 (``paged_prefill_bf16.cpp``);
- ``llama_forward``: a whole step of a bf16 LLaMA model (prompt chunks and decode tokens) in one
  call (``model/csrc/llama_forward.cpp``), so the ~25 small ops per layer are not dispatched one by one.
  Its products take bf16 dot products over the packed weights, or, in steps of at least
  ``wide_rows`` rows, widen the same packed bf16 weights to fp32 in registers and take FMAs: on
  CPUs whose bf16 dot products issue at half the rate of fp32 FMAs (a Xeon with AVX512-BF16 and no
  AMX) that is 1.2-1.8x faster from 8 rows up; ``wide_rows`` measures where, once a process.

The packed copy of a weight lives on the weight tensor itself (an attribute) and is remade when
the weight changes in place or moves: a bf16 model on the CPU holds its weights twice (the
default model: 270 MB more), an fp32 one too (540 MB more), the torch layout for everything else
that reads them.

Each call lets the GIL go while it runs: a cluster's instances, its length predictor and its event
loop are threads of one process, and must not wait for one another's kernels.

Which path a model takes is its own setting (``EngineConfig.kernels``, ``--kernels``), put on its
modules once by ``use_kernels``: ``native`` (ours, a bf16 LLaMA step in one call), ``unfused``
(ours, one call per op: for A/B measurements), ``fallback`` (torch's own ops only, no C++), or
``auto`` (native where ours build, else fallback). Every kernel has its fallback, and the tests
compare both against a float32 reference.

The build is compiled with ``-march=native``, so it is named after the instruction set it was made
for (``build_name``): a cache made on one CPU is never loaded on another, where it could die of
SIGILL; a new CPU (or compiler) gets its own build.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [str(_CSRC / name) for name in
            ("paged_attention.cpp", "paged_decode_bf16.cpp", "paged_prefill_bf16.cpp", "gemm_bf16.cpp",
             "gemm_f32.cpp", "fp32_ops.cpp", "llama_forward.cpp")]
_VERSION = "aserve_native_v12"
_HEADERS = [str(_CSRC / "kernels.h")]
KERNELS = ("auto", "native", "unfused", "fallback")  # EngineConfig.kernels (see the module doc)


def isa_key(target: str) -> str:
    """12 hex digits naming an instruction set: ``target`` is what the compiler defines for
    ``-march=native`` (or the CPU's flags). Equal targets, equal keys; any new feature, a new key."""
    return hashlib.sha256(target.encode()).hexdigest()[:12]


def _native_target() -> str:
    """The predefined macros of ``-march=native`` (``__AVX512BF16__``, ``__tune_znver3__``, the
    compiler's version, ...): exactly what the build is compiled for. Without a compiler (no
    build either), the CPU's feature flags."""
    cxx = os.environ.get("CXX", "c++")  # the compiler torch's extension builder calls
    try:
        out = subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return "\n".join(sorted(out.splitlines()))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, arm
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def sources_digest(paths=None) -> str:
    """12 hex digits of the kernels' source text (``paths``: the sources and the header, by
    default): what a step's cost depends on. A saved device profile names the kernels it timed by
    this (``kernels_build``), not by ``_VERSION`` alone, which is bumped by hand and was not when
    the k-chunk products and the four-head prefill made steps 9-10% faster: the profile measured
    before them kept pricing their steps (a simulated twin's knees 0.5-1.09x the real ones)."""
    digest = hashlib.sha256()
    for path in paths or (_SOURCES + _HEADERS):
        digest.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def kernels_build() -> str:
    """The kernels' identity a device profile keeps: the version and the sources' digest."""
    return f"{_VERSION}+{sources_digest()}"


@functools.lru_cache(maxsize=1)
def build_name() -> str:
    """The build's name in torch's extension cache, keyed by the instruction set it targets and by
    the folder its sources are in (two checkouts on one machine each keep their own build, instead
    of rebuilding over each other's)."""
    where = hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:6]
    return f"{_VERSION}_{isa_key(_native_target())}_{where}"


def build_directory() -> Path:
    """Where the build lives: ``$TORCH_EXTENSIONS_DIR`` (else ~/.cache/torch_extensions)/aserve/NAME."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(Path.home(), ".cache", "torch_extensions")
    return Path(root) / "aserve" / build_name()


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module, or raise RuntimeError saying why it cannot be built.

    Builders of one build take turns on an OS lock (``flock``: let go by the kernel when its holder
    dies). torch's own lock is a file that only its creator removes, so a build killed half-way (a
    test's server stopped while it compiled, a Ctrl-C) left every later start waiting on it forever;
    whoever holds our lock knows no one else is building, and removes such a leftover first."""
    import fcntl

    from torch.utils.cpp_extension import load as build

    where = build_directory()
    try:
        where.mkdir(parents=True, exist_ok=True)
        with open(where.parent / f"{where.name}.lock", "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            (where / "lock").unlink(missing_ok=True)
            return build(name=build_name(), sources=_SOURCES, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                         extra_include_paths=[str(_CSRC)], extra_ldflags=["-fopenmp"],
                         build_directory=str(where), verbose=False)
    except Exception as e:  # compiler missing, headers missing, ...
        raise RuntimeError(f"cannot build aserve's C++ kernels: {e}") from e


def resolve_kernels(kernels: str, device: str) -> str:
    """``EngineConfig.kernels`` for a model on ``device``: ``auto`` becomes native (a CPU where
    ours build) or fallback; native and unfused where ours cannot run are a ValueError saying why."""
    if kernels not in KERNELS:
        raise ValueError(f"bad kernels {kernels!r}: choose one of {', '.join(KERNELS)}")
    on_cpu = device == "cpu"
    if kernels == "auto":
        return "native" if on_cpu and available() else "fallback"
    if kernels != "fallback":
        if not on_cpu:
            raise ValueError(f"kernels {kernels!r} are aserve's CPU kernels; on {device} use auto or fallback")
        try:
            load()
        except RuntimeError as e:
            raise ValueError(f"kernels {kernels!r}: {e}") from None
    return kernels


def use_kernels(model: torch.nn.Module, kernels: str) -> None:
    """Point a model at our kernels or torch's ops (``kernels`` resolved: native, unfused or
    fallback). Modules that call a kernel of this file carry ``native`` (their products go to
    ours where they apply); the model carries ``native_step`` (a bf16 LLaMA step in one call)."""
    assert kernels in KERNELS[1:], kernels
    for module in model.modules():
        if hasattr(module, "native"):
            module.native = kernels != "fallback"
    model.native_step = kernels == "native"
    model.kernels = kernels


@functools.lru_cache(maxsize=1)
def available() -> bool:
    return why_unavailable() is None


@functools.lru_cache(maxsize=1)
def why_unavailable() -> Optional[str]:
    """None where the kernels build (or are cached), else why not (no compiler, no OpenMP, no
    Python headers, ...), first line only: what ``aserve serve`` says when it falls back."""
    cxx = os.environ.get("CXX", "c++")
    try:
        load()
    except RuntimeError as e:
        if shutil.which(cxx) is None:
            return f"no C++ compiler ({cxx!r} is not on PATH; set CXX to use another)"
        return str(e).strip().splitlines()[0][:200]
    return None


@functools.lru_cache(maxsize=1)
def bf16_linear_available() -> bool:
    """True where the kernels build and the CPU has AVX512-BF16 dot products."""
    return available() and load().has_bf16_linear()


@functools.lru_cache(maxsize=1)
def f32_linear_available() -> bool:
    """True where the kernels build with AVX2 FMAs: an fp32 model's products go to ``linear_f32``."""
    return available() and load().has_f32_linear()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, H_kv, D]; returns [B, H, D]."""
    return load().paged_decode(q.contiguous(), k_cache, v_cache, tables, ctx_lens, scale)


def packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of ``x`` and ``weight`` can go to our packed kernel: bf16 CPU tensors, an
    even input width, nothing for autograd to track (the kernel has no backward). Called on every
    linear of every step: cheapest tests first."""
    return (x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.device.type == "cpu"
            and weight.shape[1] % 2 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and bf16_linear_available())


def f32_packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of ``x`` and ``weight`` can go to our fp32 kernel (``linear_f32``): fp32
    CPU tensors, nothing for autograd to track, AVX2 FMAs. An fp32 model is what runs on a CPU
    without AVX512-BF16 (``loader.pick_dtype``), where torch's product packed the weight at every
    call: the default model's decode step took 60 ms of products at 1 row and 173 at 8 rows on a
    2-core Zen 3 (docs/notes/peer.md, "Issue 60, tenth session")."""
    return f32_op_applies(x, weight) and f32_linear_available()


def f32_op_applies(x: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``rms_norm`` / ``rope`` take ``x`` with ``other`` (the norm's weight, RoPE's cos): fp32
    CPU tensors, nothing for autograd to track, the kernels built."""
    return (x.dtype is torch.float32 and other.dtype is torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or other.requires_grad)) and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, weight.shape, weight, eps)`` for fp32 x in one call (``rms_norm_f32``)."""
    return load().rms_norm_f32(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``layers.apply_rope`` for fp32 x [T, heads, D] in one call (``rope_f32``): cos and the signed
    sin [T, 1, D]."""
    return load().rope_f32(x, cos, sin)


def packed_f32(weight: torch.Tensor) -> torch.Tensor:
    """The ``linear_f32`` copy of an fp32 ``weight`` [N, K] (``pack_f32x32``), made on first use
    and remade if the weight changed since (as ``packed``)."""
    return _cached_pack(weight, "_aserve_packed_f32", lambda w: load().pack_f32x32(w))


def _linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    y = load().linear_f32(x.reshape(-1, x.shape[-1]), packed_f32(weight), weight.shape[0], bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def packed(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """The packed copy of a bf16 ``weight`` [N, K] (``gate_up``: a fused [gate; up] weight in the
    order ``silu_mul`` reads), made on first use and remade if the weight changed since."""
    mod = load()
    return _cached_pack(weight, "_aserve_packed_gate_up" if gate_up else "_aserve_packed",
                        lambda w: mod.pack_bf16(w, mod.ORDER_GATE_UP if gate_up else mod.ORDER_PLAIN))


def _cached_pack(weight: torch.Tensor, key: str, make) -> torch.Tensor:
    """``make(weight)``, kept on the weight under ``key`` with its version and data pointer, and
    remade when either changed since (an in-place change, a move)."""
    cached = getattr(weight, key, None)  # (version, data pointer, packed tensor)
    if cached is not None and cached[0] == weight._version and cached[1] == weight.data_ptr():
        return cached[2]
    p = make(weight.detach())
    setattr(weight, key, (weight._version, weight.data_ptr(), p))
    return p


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           native: bool = True) -> torch.Tensor:
    """``F.linear``, through our packed bf16 kernel where it applies (see ``packable``), or our
    fp32 one (``f32_packable``), unless ``native`` is False (the fallback: torch's own)."""
    if native and packable(x, weight):
        y = load().linear_packed(x.reshape(-1, x.shape[-1]), packed(weight), weight.shape[0], bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    if native and f32_packable(x, weight):
        return _linear_f32(x, weight, bias)
    return F.linear(x, weight, bias)


def logits(x: torch.Tensor, weight: torch.Tensor, native: bool = True, widen: bool = False) -> torch.Tensor:
    """An LM head's fp32 logits [N, vocab]. Where the packed kernel applies, its fp32 sums are
    returned as they are: rounding logits to bf16 (steps of 0.125 between 16 and 32) turned
    near-ties into ties, and a tie into the wrong greedy token; elsewhere (and with ``native``
    False) the model dtype's. ``widen``: FMAs over the weight widened to fp32 (``wide_rows``)."""
    if native and packable(x, weight):
        return load().linear_packed(x, packed(weight), weight.shape[0], None, True, widen)
    if native and f32_packable(x, weight):
        return _linear_f32(x, weight, None)
    return F.linear(x, weight).float()


def silu_mul(x: torch.Tensor, gate_up: torch.Tensor, native: bool = True) -> torch.Tensor:
    """SwiGLU's ``silu(x @ gate.T) * (x @ up.T)`` for a fused ``gate_up`` weight [2 I, K]: one
    packed product with the activation in its epilogue where it applies (I a multiple of 32),
    else (and with ``native`` False) the three torch ops. Rounded to bf16 where torch's ops round,
    so both agree."""
    if native and packable(x, gate_up) and gate_up.shape[0] % 64 == 0:
        y = load().silu_mul_packed(x.reshape(-1, x.shape[-1]), packed(gate_up, gate_up=True))
        return y.view(*x.shape[:-1], gate_up.shape[0] // 2)
    gate, up = linear(x, gate_up, None, native).chunk(2, dim=-1)
    return F.silu(gate) * up


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: torch.Tensor,
                  tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of prompt chunks, bf16: q [T, H, D] (the chunks' rows), caches
    [num_blocks, block_size, H_kv, D], seqs [P, 3] (first row, end row, context length after the
    chunk), tables [P, max_blocks]. Returns [T, H, D] (rows of no chunk are 0)."""
    return load().paged_prefill(q.contiguous(), k_cache, v_cache, seqs, tables, scale)


def prefill_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill`` takes this layout: bf16, head size 32/64/128, up to 8 query
    heads per KV head, AVX512-BF16."""
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], q.shape[2]
    return (q.dtype is torch.bfloat16 and k_cache.dtype is torch.bfloat16 and d in (32, 64, 128)
            and heads % kv_heads == 0 and heads // kv_heads <= 8 and bf16_linear_available())


# step sizes wide_rows compares the two ways at: the same bf16 bytes either way, so one layer's
# products timed in cache rank them as a step's do (the default model's 121 products at one thread
# on a Xeon whose bf16 dot products issue at half the FMA rate, dot / widened: 1 row 19.7 / 20.0 ms,
# 4 rows 24.2 / 22.3, 8 rows 32.9 / 29.1, 16 rows 58.1 / 44.4, 32 rows 108 / 75, 256 rows 806 / 503)
WIDE_ROWS_TRIED = (4, 8, 16, 32, 64)
WIDE_GAIN = 1.1  # widening is taken where it was at least this much faster


_WIDE_LOCK = threading.Lock()


def wide_rows(shapes: tuple, threads: int) -> int:
    """``_wide_rows``, measured once a process even when two instances' first steps ask at once
    (each measuring would time the products twice, against each other's)."""
    with _WIDE_LOCK:
        return _wide_rows(shapes, threads)


@functools.lru_cache(maxsize=None)
def _wide_rows(shapes: tuple, threads: int) -> int:
    """The fewest rows of a step from which its products (``shapes``: each product's (outputs,
    inputs), a layer's four) widen the packed bf16 weights to fp32 in registers and take FMAs
    (``llama_forward(..., widen=True)``) instead of bf16 dot products, at ``threads`` torch
    threads (the caller's); 0: never. Measured once a process per thread count (0.1-0.3 s): a
    layer's products timed both ways in turns at ``WIDE_ROWS_TRIED`` rows; the smallest size from
    which widening is ``WIDE_GAIN`` faster at every larger size is taken. Where bf16 dot products
    issue at half the rate of fp32 FMAs (a 2-core Xeon with AVX512-BF16 and no AMX: 86 against 175
    GFLOP/s a core), widening wins once the rows are enough to make the products compute-bound
    (1.3x at 16 rows, 1.6x from 64); where dot products issue at the FMA rate or above (Zen 5),
    it never does. ``ASERVE_WIDE_ROWS=N`` sets it (0: never)."""
    env = os.environ.get("ASERVE_WIDE_ROWS")
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"ASERVE_WIDE_ROWS must be a whole number of rows (0: never), got {env!r}")
        return int(env)
    if not bf16_linear_available():
        return 0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        mod = load()
        weights = [(n, k, mod.pack_bf16(torch.randn(n, k, generator=gen).to(torch.bfloat16), mod.ORDER_PLAIN))
                   for n, k in shapes]
        faster = []
        for rows in WIDE_ROWS_TRIED:
            xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k, _ in weights}
            times = {False: [], True: []}  # dot products, widened
            for rep in range(6):  # the first of each unmeasured: a first call sets things up
                for widen, seen in times.items():
                    t0 = time.perf_counter()
                    for n, k, w in weights:
                        mod.linear_packed(xs[k], w, n, None, False, widen)
                    if rep:
                        seen.append(time.perf_counter() - t0)
            faster.append(min(times[False]) >= WIDE_GAIN * min(times[True]))
    finally:
        torch.set_num_threads(before)
    cut = 0
    for rows, ok in zip(reversed(WIDE_ROWS_TRIED), reversed(faster)):
        if not ok:
            break
        cut = rows
    return cut


wide_rows.cache_clear = _wide_rows.cache_clear  # the measured cuts forgotten (tests set ASERVE_WIDE_ROWS)


def step_weights(params: list) -> list:
    """``llama_forward``'s weights from the six Parameters of each layer (attn_norm, qkv, o,
    mlp_norm, gate_up, down): the norms as they are, the four matrices packed."""
    step = []
    for i in range(0, len(params), 6):
        attn_norm, qkv, o, mlp_norm, gate_up, down = params[i:i + 6]
        step += [attn_norm, packed(qkv), packed(o), mlp_norm, packed(gate_up, gate_up=True), packed(down)]
    return step


def llama_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: list, final_norm: torch.Tensor,
                  kv: torch.Tensor, meta, num_heads: int, eps: float, scale: float, tap_layer: int = 0,
                  tap_rows: Optional[torch.Tensor] = None, widen: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole step through every layer (prompt chunks, decode tokens, pad rows): x [T, E] bf16
    embeddings -> (final-normed hidden [T, E], taps [R, E]): the taps are ``tap_rows`` after
    ``tap_layer`` layers through the final norm (empty unless asked); ``weights`` as
    ``step_weights`` makes them; ``widen``: the products widen the weights to fp32 FMAs instead of
    taking bf16 dot products (``wide_rows``); ``meta`` is the step's ``AttentionMeta``."""
    seqs, seq_tables = meta.chunk_tables
    dec_tables, dec_lens = meta.decode_block_tables, meta.decode_ctx_lens
    if dec_tables is None:
        dec_tables, dec_lens = _NO_ROWS, _NO_ROWS[:, 0]
    return tuple(load().llama_forward(x, cos, sin, weights, final_norm, kv, meta.slot_mapping, seqs, seq_tables,
                                      dec_tables, dec_lens, num_heads, eps, scale, tap_layer,
                                      _NO_ROWS[:, 0] if tap_rows is None else tap_rows, widen))


_NO_ROWS = torch.zeros(0, 3, dtype=torch.long)  # no chunk (as [P, 3]) or no decode row


def chunk_tables(prefills) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt chunks of a step as ``llama_forward`` and ``paged_prefill`` take them:
    [P, 3] (first row, end row, context length) and their block tables [P, max_blocks]."""
    if not prefills:
        return _NO_ROWS, _NO_ROWS
    seqs = torch.tensor([(p.start, p.end, p.ctx_len) for p in prefills], dtype=torch.long)
    width = max(p.block_ids.numel() for p in prefills)
    tables = torch.zeros(len(prefills), width, dtype=torch.long)
    for i, p in enumerate(prefills):
        tables[i, :p.block_ids.numel()] = p.block_ids
    return seqs, tables
