"""Every policy name, as configs and the command line spell them: one table per kind.

    prefill   the prefill instance's queue order           (scheduling/prefill.py)
    decode    the decode instance's admission              (scheduling/decode.py)
    dispatch  which decode instance takes a prefilled request (scheduling/dispatch.py)
    batching  the coupled instance's batching              (scheduling/coupled.py, alise.py)
    adaptive  adaptive mode's scheduler, for either role   (scheduling/hybrid.py)
    flip      when an instance changes role                (scheduling/flip.py)

``get("decode", "reserve-static")`` returns the class; the caller builds it with its blocks and
config. Unknown kinds or names raise ``ValueError`` listing what is valid. A new policy is a
class with a ``name`` in its kind's module, listed here.
"""
from __future__ import annotations

from scheduling.alise import AliseScheduler
from scheduling.coupled import SarathiScheduler, VllmScheduler
from scheduling.decode import (DecodeScheduler, ReserveDynamicDecodeScheduler,
                               ReserveStaticDecodeScheduler)
from scheduling.dispatch import (ImbalanceDispatcher, InterferenceDispatcher,
                                 LeastLoadedDispatcher, RandomDispatcher, RoundRobinDispatcher)
from scheduling.flip import FlipPolicy, IdleFlipPolicy, RatioFlipPolicy
from scheduling.hybrid import HybridScheduler
from scheduling.prefill import LJFPrefillScheduler, PrefillScheduler, SJFPrefillScheduler


def _by_name(*classes: type) -> dict[str, type]:
    table = {cls.name: cls for cls in classes}
    assert len(table) == len(classes), "policy names must be unique"
    return table


POLICIES: dict[str, dict[str, type]] = {
    "prefill": _by_name(PrefillScheduler, SJFPrefillScheduler, LJFPrefillScheduler),
    "decode": _by_name(DecodeScheduler, ReserveStaticDecodeScheduler, ReserveDynamicDecodeScheduler),
    "dispatch": _by_name(InterferenceDispatcher, RandomDispatcher, RoundRobinDispatcher,
                         LeastLoadedDispatcher, ImbalanceDispatcher),
    "batching": _by_name(SarathiScheduler, VllmScheduler, AliseScheduler),
    "adaptive": _by_name(HybridScheduler),
    "flip": _by_name(FlipPolicy, IdleFlipPolicy, RatioFlipPolicy),
}


def names(kind: str) -> tuple[str, ...]:
    """The policy names of ``kind``, in the order they are listed."""
    return tuple(_table(kind))


def get(kind: str, name: str) -> type:
    """The class registered as ``name`` among ``kind``."""
    table = _table(kind)
    if name not in table:
        raise ValueError(f"unknown {kind} policy {name!r}; valid names: {', '.join(table)}")
    return table[name]


def _table(kind: str) -> dict[str, type]:
    if kind not in POLICIES:
        raise ValueError(f"unknown policy kind {kind!r}; valid kinds: {', '.join(POLICIES)}")
    return POLICIES[kind]
