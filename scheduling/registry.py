"""Names to policy classes, as configs and the CLI spell them.

``get("decode", "reserve-static")`` returns the class; the caller builds it with its blocks and
config. Unknown kinds or names raise ``ValueError`` listing what is valid.
"""
from __future__ import annotations

from scheduling.decode import (DecodeScheduler, ReserveDynamicDecodeScheduler,
                               ReserveStaticDecodeScheduler)
from scheduling.dispatch import (ImbalanceDispatcher, InterferenceDispatcher,
                                 LeastLoadedDispatcher, RandomDispatcher, RoundRobinDispatcher)
from scheduling.prefill import LJFPrefillScheduler, PrefillScheduler, SJFPrefillScheduler


def _by_name(*classes: type) -> dict[str, type]:
    table = {cls.name: cls for cls in classes}
    assert len(table) == len(classes), "policy names must be unique"
    return table


PREFILL_POLICIES = _by_name(PrefillScheduler, SJFPrefillScheduler, LJFPrefillScheduler)
DISPATCH_POLICIES = _by_name(InterferenceDispatcher, RandomDispatcher, RoundRobinDispatcher,
                             LeastLoadedDispatcher, ImbalanceDispatcher)
DECODE_POLICIES = _by_name(DecodeScheduler, ReserveStaticDecodeScheduler,
                           ReserveDynamicDecodeScheduler)

_KINDS = {"prefill": PREFILL_POLICIES, "dispatch": DISPATCH_POLICIES, "decode": DECODE_POLICIES}


def get(kind: str, name: str) -> type:
    """The class registered as ``name`` among ``kind`` (prefill | dispatch | decode)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown policy kind {kind!r}; valid kinds: {', '.join(_KINDS)}")
    table = _KINDS[kind]
    if name not in table:
        raise ValueError(f"unknown {kind} policy {name!r}; valid names: {', '.join(table)}")
    return table[name]
