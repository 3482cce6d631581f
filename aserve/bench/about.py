"""What a result file says about itself: the command that made it, the commit, the date, the machine.

Results are data (docs/RESULTS.md is generated from ``results/*.json``): a number without the
command, commit and machine that made it cannot be rerun or weighed.
"""
from __future__ import annotations

import datetime
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def about(argv: Optional[Sequence[str]] = None) -> dict:
    """``{"command", "commit", "dirty", "date", "machine"}`` for this process (``argv``: the
    command's arguments, default this process's)."""
    from aserve.profiles.device_profile import machine

    args = list(sys.argv[1:] if argv is None else argv)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"command": "aserve " + shlex.join(args), "commit": _git("rev-parse", "--short=12", "HEAD"),
            "dirty": bool(status) if status is not None else None,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine()}
