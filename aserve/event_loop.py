"""Running the event loop: uvloop when it is installed, plain asyncio otherwise."""
from __future__ import annotations

import asyncio


def run(coro):
    """``asyncio.run`` on uvloop's loop when available (faster callbacks, same semantics)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
