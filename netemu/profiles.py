"""Link profiles, the ``--link`` parser and the ``--emulate-model`` table. Pure Python.

A profile says how fast one interconnect moves bytes. TetriInfer's decode instances receive
the KV cache over one of three kinds of path between a prefill and a decode instance:

```
 direct  (nvlink, roce)    src device ───────────────────────────────► dst device   1 copy
 indirect (pcie)           src device ──PCIe──► host memory ──PCIe──► dst device   2 copies
```

``num_copies`` counts the hops. The indirect path is store-and-forward (the whole KV goes to
host memory, then on to the receiver), so each hop pays its bytes and its latency:
``transfer_time = num_copies * (nbytes / bandwidth + latency)`` on an idle link.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

# Decimal SI prefixes, as link vendors quote them; binary ones for people who think in GiB.
_BYTE_RATES = {
    "B/s": 1.0, "KB/s": 1e3, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30,
}
# Bits per second: the unit NICs are sold in (RoCE 200 Gb/s = 25 GB/s).
_BIT_RATES = {"b/s": 1.0, "Kb/s": 1e3, "kb/s": 1e3, "Mb/s": 1e6, "Gb/s": 1e9, "Tb/s": 1e12}
BANDWIDTH_UNITS = {**_BYTE_RATES, **{u: f / 8 for u, f in _BIT_RATES.items()}}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class LinkProfile:
    """One interconnect: bandwidth per hop, latency per hop, and the number of hops (copies)."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    num_copies: int = 1

    def __post_init__(self):
        if not self.name:
            raise ValueError("name: a link profile needs a name")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bw: bandwidth must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency: must be >= 0, got {self.latency_s!r}")
        if not isinstance(self.num_copies, int) or self.num_copies < 1:
            raise ValueError(f"copies: must be an integer >= 1, got {self.num_copies!r}")

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link when nothing else uses it."""
        return self.num_copies * (nbytes / self.bandwidth_bytes_per_s + self.latency_s)


PROFILES: dict[str, LinkProfile] = {
    # NVLink on the paper's V100 servers: 300 GB/s aggregate; a few µs per copy.
    "nvlink": LinkProfile("nvlink", 300e9, 3e-6),
    # RoCE NIC of 200 Gb/s; RDMA latency a few µs, call it 5.
    "roce": LinkProfile("roce", 200e9 / 8, 5e-6),
    # The paper's "Indirect" type: device -> host -> device over PCIe 4.0 x16 (~25 GB/s
    # effective each way). The latency includes a memcpy launch per hop.
    "pcie": LinkProfile("pcie", 25e9, 10e-6, num_copies=2),
}

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(\S*)\s*$")


def _parse_quantity(field: str, text: str, units: dict[str, float]) -> float:
    """``'25GB/s'`` -> 25e9; errors name ``field`` and list the accepted units."""
    m = _NUMBER.match(text)
    if m is None or m.group(2) not in units:
        raise ValueError(f"{field}: cannot read {text!r}; expected a number with a unit, "
                         f"one of {', '.join(units)}")
    return float(m.group(1)) * units[m.group(2)]


def parse_link(spec: str) -> LinkProfile:
    """A ``LinkProfile`` from a profile name or ``bw=...,latency=...[,copies=N][,name=X]``.

    A profile name may lead and be overridden field by field: ``"roce,latency=10us"``.
    Examples: ``"nvlink"``, ``"bw=200Gb/s,latency=5us"``, ``"pcie,bw=16GB/s"``.
    Raises ``ValueError`` whose message starts with the offending field.
    """
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"link: empty spec; give a profile ({', '.join(PROFILES)}) "
                         "or bw=...,latency=...")
    base: Optional[LinkProfile] = None
    if "=" not in parts[0]:
        base = PROFILES.get(parts[0].lower())
        if base is None:
            raise ValueError(f"link: unknown profile {parts[0]!r}; known: {', '.join(PROFILES)}")
        parts = parts[1:]
    fields: dict[str, object] = {}
    for part in parts:
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep:
            raise ValueError(f"link: {part!r} is not key=value")
        fields.update(_parse_field(key.lower(), value))
    if base is not None:
        return replace(base, **fields)
    if "bandwidth_bytes_per_s" not in fields:
        raise ValueError("bw: missing; a custom link needs bw=... (e.g. bw=25GB/s)")
    fields.setdefault("name", "custom")
    fields.setdefault("latency_s", 0.0)
    return LinkProfile(**fields)


def _parse_field(key: str, value: str) -> dict[str, object]:
    if key in ("bw", "bandwidth"):
        return {"bandwidth_bytes_per_s": _parse_quantity("bw", value, BANDWIDTH_UNITS)}
    if key in ("latency", "lat"):
        return {"latency_s": _parse_quantity("latency", value, TIME_UNITS)}
    if key == "copies":
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"copies: expected an integer >= 1, got {value!r}")
        return {"num_copies": int(value)}
    if key == "name":
        return {"name": value}
    raise ValueError(f"{key}: unknown link field; known: bw, latency, copies, name")


# ---- KV size emulation ---------------------------------------------------------------------
# A small real model runs here, but the link can be charged as if a big one's KV were moving:
# the paper's OPT-13B has ~36x the KV per token of SmolLM2-135M.


@dataclass(frozen=True)
class ModelKVShape:
    """What one token's KV cache weighs: K and V for every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # fp16 / bf16

    def __post_init__(self):
        assert min(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes) > 0

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


KV_SHAPES: dict[str, ModelKVShape] = {
    "opt-13b": ModelKVShape(40, 40, 128),        # 2 * 40 * 5120 * 2 = 819,200 B
    "opt-125m": ModelKVShape(12, 12, 64),        # 36,864 B
    "llama-2-7b": ModelKVShape(32, 32, 128),     # 524,288 B
    "llama-2-13b": ModelKVShape(40, 40, 128),    # 819,200 B
    "smollm2-135m": ModelKVShape(30, 3, 64),     # 23,040 B (GQA: 3 KV heads)
}


def model_kv_bytes_per_token(model: str) -> int:
    """KV bytes per token of a known model; accepts HF ids (``facebook/opt-13b``, ``...-hf``)."""
    key = model.strip().lower().rsplit("/", 1)[-1].removesuffix("-hf")
    if key not in KV_SHAPES:
        raise ValueError(f"emulate-model: unknown model {model!r}; known: {', '.join(KV_SHAPES)}")
    return KV_SHAPES[key].bytes_per_token


@dataclass(frozen=True)
class KVEmulation:
    """How many bytes the link is charged for a transfer: real ones, or a bigger model's.

    Built from ``--emulate-model NAME`` or ``--emulate-kv-bytes-per-token N`` (not both).
    """

    kv_bytes_per_token: Optional[int] = None  # None: charge the real bytes

    def __post_init__(self):
        n = self.kv_bytes_per_token
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"emulate-kv-bytes-per-token: expected an integer >= 1, got {n!r}")

    @classmethod
    def from_args(cls, model: Optional[str] = None,
                  kv_bytes_per_token: Optional[int] = None) -> "KVEmulation":
        if model is not None and kv_bytes_per_token is not None:
            raise ValueError("emulate-model: give --emulate-model or "
                             "--emulate-kv-bytes-per-token, not both")
        if model is not None:
            return cls(model_kv_bytes_per_token(model))
        return cls(kv_bytes_per_token)

    def nbytes(self, num_tokens: int, real_nbytes: int) -> int:
        """Bytes to charge the link for ``num_tokens`` tokens whose KV really is ``real_nbytes``."""
        assert num_tokens >= 0 and real_nbytes >= 0
        if self.kv_bytes_per_token is None:
            return real_nbytes
        return num_tokens * self.kv_bytes_per_token
