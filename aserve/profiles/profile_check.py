"""Does a measured profile describe the instances it is about to time?

A measured profile (``aserve profile device``: ``sim:local``, ``sim:FILE.json``, the cached one
the chunk size, the token budget and the SLO corners come from) is a CPU's step times under one
setting. Used for instances of another setting it predicts the wrong machine, silently: measured
at two threads and used for 1P + 1D at one thread each, a replay came out 48% short (issue 58).
So its ``meta`` is read against the instances:

    refused (a different engine)    model, threads (CPU profiles), dtype, attention, kernels
    warned (a different moment)     another machine (CPU name, cores, ISA flags), older than
                                    MAX_AGE_DAYS, measured while the machine was busy
                                    (``--allow-busy``), or a field it does not record (profiles
                                    measured before it was recorded: nothing to check it by)

A refusal names each field and the command that measures the right profile; the engine flag
``--allow-profile-mismatch`` turns it into a warning. Where the profile was measured on another
machine, a setting left to ``auto`` is taken to mean what that machine chose.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from datetime import date
from typing import Optional

CHECKED = ("model", "threads", "dtype", "attention", "kernels")  # a mismatch is refused
RECORDED = CHECKED + ("machine", "cpu_flags", "date", "rest")  # an absent field is warned about
MAX_AGE_DAYS = 30  # a profile older than this warns: the software and the machine move on
ALLOW_FLAG = "--allow-profile-mismatch"
DEFAULT_MODELS = ("default", "smollm2-135m-instruct")  # two names of one model (model/loader.py DEFAULT_MODEL)


@dataclass(frozen=True)
class Mismatch:
    field: str
    profile: object  # what the profile was measured with
    instances: object  # what the instances run with


def mismatches(meta: dict, wanted: dict) -> list[Mismatch]:
    """The ``CHECKED`` fields whose value differs between the profile's ``meta`` and ``wanted``
    (the instances' resolved settings); a field absent from either is not compared."""
    out = []
    for name in CHECKED:
        if name in meta and name in wanted and not _same(name, meta[name], wanted[name]):
            out.append(Mismatch(name, meta[name], wanted[name]))
    return out


def _same(name: str, a, b) -> bool:
    if name == "model" and a in DEFAULT_MODELS and b in DEFAULT_MODELS:
        return True
    return str(a) == str(b)


def unknown(meta: dict) -> list[str]:
    """The ``RECORDED`` fields a profile does not record."""
    return [name for name in RECORDED if name not in meta]


def measure_command(cfg, threads: int, out: Optional[str] = None) -> str:
    """The ``aserve profile device`` line that measures a profile for instances of ``cfg`` at
    ``threads`` each, on this machine (the settings a user left to ``auto`` resolve here as for
    the instances)."""
    parts = ["aserve profile device", f"--threads {threads}"]
    for flag, value, default in (("--model", cfg.model, "default"), ("--dtype", cfg.dtype, "auto"),
                                 ("--attention", cfg.attention, "auto"), ("--kernels", cfg.kernels, "auto")):
        if value != default:
            parts.append(f"{flag} {value}")
    if out:
        parts.append(f"--out {out}")
    return " ".join(parts)


def refusal(name: str, found: list[Mismatch], command: str) -> str:
    """What a refused profile says: each field as measured and as the instances run, the command
    that measures the right one, and the flag that goes on anyway."""
    return (f"{_differs(name, found)}. Its step times would be wrong for these instances. Measure the right "
            f"profile (on a machine at rest): {command}; or pass {ALLOW_FLAG} to use this one anyway")


def _differs(name: str, found: list[Mismatch]) -> str:
    fields = "; ".join(f"{m.field} {m.profile} in the profile, {m.instances} for these instances" for m in found)
    return f"{name} was measured for another engine than the one simulated: {fields}"


def load_warnings(name: str, meta: dict, this_machine: str, these_flags: list[str],
                  today: Optional[date] = None, command: str = "aserve profile device") -> list[str]:
    """What a measured profile's use should say about when and where it was measured (empty: nothing)."""
    out = []
    rest = meta.get("rest")
    if isinstance(rest, dict) and not rest.get("at_rest", True):
        why = "; ".join(rest.get("why", ())) or "the machine was busy"
        kept = "kept with --allow-busy" if rest.get("allowed_busy") else \
            "measured on first need; measured again by the first run that finds the machine at rest"
        out.append(f"{name} was measured while the machine was not at rest ({why}; {kept}): its step times are "
                   f"likely too slow. Measure again at rest: {command}")
    missing = unknown(meta)
    if missing:
        out.append(f"{name} does not record {', '.join(missing)} (measured before aserve recorded "
                   f"{'them' if len(missing) > 1 else 'it'}): "
                   + ("nothing says it was measured at rest; " if "rest" in missing else "")
                   + f"those are unchecked. Measure again to record them: {command}")
    if meta.get("machine") and meta["machine"] != this_machine:
        out.append(f"{name} was measured on {meta['machine']}, not this machine ({this_machine}): it predicts that "
                   "machine's step times, not this one's")
    elif "cpu_flags" in meta and list(meta["cpu_flags"]) != list(these_flags):
        out.append(f"{name} was measured on a CPU with flags {' '.join(meta['cpu_flags']) or 'none'}, this one has "
                   f"{' '.join(these_flags) or 'none'}: other kernels may run here")
    age = _age_days(meta.get("date"), today or date.today())
    if age is not None and age > MAX_AGE_DAYS:
        out.append(f"{name} was measured {age} days ago ({meta['date']}; more than {MAX_AGE_DAYS}): the software and "
                   f"the machine may have changed since. Measure again: {command}")
    return out


def _age_days(measured: Optional[str], today: date) -> Optional[int]:
    try:
        return (today - date.fromisoformat(str(measured))).days
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def warn(message: str) -> None:
    """A warning on stderr, once per process (a profile is read again for every instance)."""
    print(f"aserve: warning: {message}", file=sys.stderr, flush=True)


def check(name: str, meta: dict, wanted: dict, command: str, allow_mismatch: bool, this_machine: str,
          these_flags: list[str]) -> None:
    """Refuse (ValueError) a profile measured for other instances than ``wanted`` unless
    ``allow_mismatch`` (then warn); warn about when and where it was measured."""
    found = mismatches(meta, wanted)
    if found and not allow_mismatch:
        raise ValueError(refusal(name, found, command))
    if found:
        warn(f"{_differs(name, found)}; used anyway ({ALLOW_FLAG}): its step times are likely wrong for these "
             "instances")
    for line in load_warnings(name, meta, this_machine, these_flags, command=command):
        warn(line)


def instance_fields(cfg, threads: int, meta: dict, same_machine: bool) -> dict:
    """The settings instances of ``cfg`` at ``threads`` torch threads each run with, resolved as
    a profile records them, for the ``CHECKED`` fields ``meta`` records. A setting left to
    ``auto`` resolves on this machine where the profile was measured here; on another machine
    it means whatever that one chose (it is not compared). Imports the model package (torch)
    only where an ``auto`` must be resolved."""
    device = str(meta.get("device", "cpu"))
    kind = "cuda" if device.startswith("cuda") else "cpu"
    out = {}
    if "model" in meta:
        out["model"] = cfg.model
    if "threads" in meta and kind == "cpu":
        out["threads"] = threads
    if "dtype" in meta and (cfg.dtype != "auto" or same_machine):
        from model.loader import pick_dtype

        out["dtype"] = str(pick_dtype(cfg.dtype, kind)).removeprefix("torch.")
    kernels = cfg.kernels
    if kernels == "auto" and same_machine and ("kernels" in meta or ("attention" in meta and cfg.attention == "auto")):
        from model import native

        kernels = "native" if kind == "cpu" and native.available() else "fallback"
    if "kernels" in meta and kernels != "auto":
        out["kernels"] = kernels
    if "attention" in meta and cfg.attention != "auto":
        out["attention"] = cfg.attention
    elif "attention" in meta and same_machine:
        from model.attention import pick_backend
        from model.loader import pick_dtype

        dtype = pick_dtype(cfg.dtype, kind)
        out["attention"] = pick_backend("auto", kind, kernels != "fallback", cfg.block_size, dtype)
    return out
