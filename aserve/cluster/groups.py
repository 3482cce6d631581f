"""The n choices of one prompt in the control plane: one computes the prompt, the rest wait for it.

The API submits the ``n`` choices of a prompt as requests of one ``prefix_group``. The first is
placed at once; the others are held here, in the request table but on no instance, until the
first's prompt is in its KV blocks (its first token) and then placed beside it, where they start
on its blocks and compute only the prompt's last block (scheduling/prefix.py)::

    submit c0 ─► placed ─► prompt computed (first token) ─► c1..cn-1 placed on c0's instance
    submit c1..cn-1 ─► held ──────────────────────────────┘  (or placed as usual if c0 ended first)

Placed together at once, the n choices would each compute the prompt in the same step (and the
least-loaded placement would spread them over instances): n prefills instead of one.
"""
from __future__ import annotations

from aserve.cluster.requests import RequestHandle


class PrefixGroups:
    """The groups whose first member has not computed its prompt yet, with the members held."""

    def __init__(self):
        self._open: dict[str, list[RequestHandle]] = {}  # group -> [first, held siblings ...]

    def hold(self, handle: RequestHandle) -> bool:
        """True: a sibling is computing the prompt, so ``handle`` waits (the caller places it
        later); False: place it now (no group, or it is the group's first)."""
        gid = handle.request.prefix_group
        if gid is None:
            return False
        members = self._open.get(gid)
        if members is None:
            self._open[gid] = [handle]
            return False
        members.append(handle)
        return True

    def release(self, first: RequestHandle) -> list[RequestHandle]:
        """``first`` computed its prompt, or ended without: its held siblings still queued, to place
        now (none when ``first`` leads no open group)."""
        gid = first.request.prefix_group
        members = self._open.get(gid) if gid is not None else None
        if not members or members[0] is not first:
            return []
        del self._open[gid]
        return [h for h in members[1:] if h.phase == "queued" and not h.aborted]

    @property
    def num_held(self) -> int:
        return sum(len(m) - 1 for m in self._open.values())
