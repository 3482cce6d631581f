"""``aserve profile device|token-budget``: measure the engine to choose settings."""
from __future__ import annotations

import argparse

from aserve.commands.common import add_engine_args


def register(subparsers) -> None:
    pr = subparsers.add_parser("profile", help="measure the engine to choose settings")
    prsub = pr.add_subparsers(dest="profile", required=True)
    pd = prsub.add_parser("device", help="this machine's step costs (the chunk size and token budget defaults "
                                         "come from them; a simulated device can run on them)")
    pd.add_argument("--out", default=None, help="also write the profile (JSON) here")
    pd.add_argument("--reps", type=int, default=3, help="timed steps per point, after one warm-up (median)")
    add_engine_args(pd)
    pd.set_defaults(func=cmd_profile_device)
    pt = prsub.add_parser("token-budget", help="the largest Sarathi token budget whose iteration meets a TBT SLO "
                                               "(--tbt-slo, required here)")
    pt.add_argument("--decode-batch", type=int, default=32, help="running decodes in each iteration")
    pt.add_argument("--context", type=int, default=512, help="tokens of context of each decode and of the chunk")
    pt.add_argument("--tile", type=int, default=64, help="candidates and the result are multiples of this")
    pt.add_argument("--max-budget", type=int, default=4096, help="largest budget tried")
    pt.add_argument("--repeats", type=int, default=3, help="timed iterations per budget, after one warm-up")
    pt.add_argument("--no-save", action="store_true", help="do not save the budget as the sarathi default")
    add_engine_args(pt)
    pt.set_defaults(func=cmd_profile_budget)


def _engine(a: argparse.Namespace):
    """The engine as measured: the budget a run would derive does not matter here."""
    from aserve.config import EngineConfig

    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, attention=a.attention, block_size=a.block_size,
                        num_threads=a.threads, cache_dir=a.cache_dir, seed=a.seed)


def cmd_profile_budget(a: argparse.Namespace) -> int:
    from aserve.bench.token_budget import BudgetProfile, run_budget_profile

    if a.tbt_slo is None:
        raise ValueError("profile token-budget needs --tbt-slo SECONDS")
    prof = BudgetProfile(a.tbt_slo, a.decode_batch, a.context, a.tile, a.max_budget, a.repeats)
    run_budget_profile(_engine(a), prof, save=not a.no_save)
    return 0


def cmd_profile_device(a: argparse.Namespace) -> int:
    import os

    from aserve.engine.device_profile import measure_and_save

    if a.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {a.reps}")
    measure_and_save(_engine(a), a.threads or os.cpu_count() or 1, a.reps, a.out)
    return 0
