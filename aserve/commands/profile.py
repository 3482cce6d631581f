"""``aserve profile token-budget``: measure the engine to choose a setting."""
from __future__ import annotations

import argparse

from aserve.commands.common import add_engine_args, engine_config


def register(subparsers) -> None:
    pr = subparsers.add_parser("profile", help="measure the engine to choose a setting")
    prsub = pr.add_subparsers(dest="profile", required=True)
    pt = prsub.add_parser("token-budget", help="the largest Sarathi token budget whose iteration meets a TBT SLO")
    pt.add_argument("--tbt-slo", type=float, required=True, help="time-between-tokens SLO, seconds")
    pt.add_argument("--decode-batch", type=int, default=32, help="running decodes in each iteration")
    pt.add_argument("--context", type=int, default=512, help="tokens of context of each decode and of the chunk")
    pt.add_argument("--tile", type=int, default=64, help="candidates and the result are multiples of this")
    pt.add_argument("--max-budget", type=int, default=4096, help="largest budget tried")
    pt.add_argument("--repeats", type=int, default=3, help="timed iterations per budget, after one warm-up")
    pt.add_argument("--no-save", action="store_true", help="do not save the budget as the sarathi default")
    add_engine_args(pt)
    pt.set_defaults(func=cmd_profile_budget)


def cmd_profile_budget(a: argparse.Namespace) -> int:
    from aserve.bench.token_budget import BudgetProfile, run_budget_profile

    prof = BudgetProfile(a.tbt_slo, a.decode_batch, a.context, a.tile, a.max_budget, a.repeats)
    run_budget_profile(engine_config(a), prof, save=not a.no_save)
    return 0
