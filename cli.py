"""aserve's entry point: every subcommand lives in aserve/commands/. Nothing imports this file."""
from __future__ import annotations

import sys

from aserve.commands import main

if __name__ == "__main__":
    sys.exit(main())
