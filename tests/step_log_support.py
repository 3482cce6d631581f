"""What a replay's step log must agree with: its report (used on simulated and real devices)."""
from __future__ import annotations

import pytest


def check_step_log(lines: list[dict], name: str, system: dict) -> None:
    """``lines`` (the step log, every system's) against system ``name``'s report: per instance,
    the logged steps' busy seconds, padding and tokens (chunks' rows plus decode rows) sum to
    what the report says it computed. Every step computes a token, so a step missing from the
    log, or logged twice, changes a sum."""
    mine = [x for x in lines if x["system"] == name]
    assert mine and {x["instance"] for x in mine} <= {i["id"] for i in system["instances"]}
    for inst in system["instances"]:
        steps = [x for x in mine if x["instance"] == inst["id"]]
        assert all(x["role"] == inst["role"] for x in steps)
        assert sum(x["busy_s"] for x in steps) == pytest.approx(inst["busy_s"])
        assert sum(x["pad"] for x in steps) == inst["pad_tokens"]
        computed = sum(len(x["decodes"]) for x in steps) + sum(n for x in steps for n, _ in x["chunks"])
        assert computed == inst["prefill_tokens"] + (inst["decode_tokens"] if inst["role"] != "prefill" else 0)
