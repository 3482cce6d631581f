"""``--slo`` and ``--goodput``: the SLO flags of ``replay`` and ``bench goodput`` (aserve/replay/slo.py)."""
from __future__ import annotations

import argparse
from typing import Optional

from aserve.commands.common import bundle_engine, instance_threads


def add_slo_args(p: argparse.ArgumentParser, corner_help: str = "") -> None:
    from aserve.replay.slo import CORNERS

    g = p.add_argument_group("SLOs (a request is good if it completed and meets every limit given)")
    g.add_argument("--slo", default=None, metavar="CORNER|KEY=S,...",
                   help=f"a named corner ({', '.join(CORNERS)}: multiples of the device's own unloaded prefill "
                        "and decode-step times, aserve/replay/slo.py) or absolute limits, e.g. ttft=1,tpot=200ms "
                        "(keys ttft, tpot, token_gap, e2el, norm)" + corner_help)
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="vllm bench serve's form, milliseconds: --goodput ttft:250 tpot:100 token_gap:1000 e2el:30000 "
                        "(token_gap: the request's own largest gap between tokens); with --slo CORNER it adds or "
                        "replaces that corner's limits")


def device_label(ns: argparse.Namespace) -> str:
    """The device whose unloaded costs a corner reads, in words."""
    if ns.device.startswith("sim:"):
        return ns.device
    threads = instance_threads(ns)
    return f"{ns.device}, {threads} thread{'s' if threads != 1 else ''} a device"


def slo_from_args(a: argparse.Namespace, ns: Optional[argparse.Namespace] = None):
    """The ``Slo`` of ``a``'s flags (None without any); a corner reads the unloaded costs of the
    device ``ns`` describes (a system's flags; default ``a``'s own): its simulated profile, or this
    machine's measured engine at the instances' threads (measured once, then cached)."""
    from aserve.replay.slo import build_slo

    return build_slo(a.slo, a.goodput, lambda: device_costs(ns or a))


def device_costs(ns: argparse.Namespace):
    """The unloaded costs of the device ``ns`` (a system's flags) describes."""
    from aserve.devices.factory import device_cost
    from aserve.replay.slo import UnloadedCosts

    return UnloadedCosts(device_cost(bundle_engine(ns), instance_threads(ns)), device_label(ns))
