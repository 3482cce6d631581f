"""Where each instance's Ray actor goes: placement groups for the P/D layout, and hosts marked
for a role.

    --ray-placement auto     Ray's default scheduler: any host with the actor's CPUs (or GPU) free
    --ray-placement pools    a placement group per role (prefill, decode, coupled), strategy PACK:
                             each pool on as few hosts as possible, so hand-overs inside a pool's
                             hosts stay local; the pools may share a host where it has room
    --ray-placement spread   one group over every instance, SPREAD: each on a host of its own
                             where there are enough (the roce profile's setting)
    --ray-placement pack     one group over every instance, PACK: prefill and decode together on
                             as few hosts as possible (the nvlink profile's setting)

Hosts marked for a role: a host started with ``ray start --resources '{"aserve_decode": 8}'``
(or ``aserve_prefill``, ``aserve_coupled``) takes that role's actors, and once any host of the
cluster carries a role's mark, that role's actors go only to hosts that carry it (each asks for
``ROLE_SLIVER`` of it, so the number is a label, not a count). A flip keeps its actor where it is.

The groups cover the instances a cluster starts with, in order; an instance added later (or
re-created after a failure) is placed by Ray's default scheduler on the marked hosts. The groups
are removed when the cluster closes.
"""
from __future__ import annotations

from aserve.config import RAY_PLACEMENTS as PLACEMENTS
from aserve.engine.policies import ROLES
ROLE_SLIVER = 0.001


def role_resource(role: str) -> str:
    return f"aserve_{role}"


class Placement:
    """The groups of one cluster (made at start from its planned roles) and each role's marks.
    ``cpus``: the CPUs each instance's actor asks for (0 for GPU actors); ``gpus``: 0 or 1."""

    def __init__(self, how: str, roles: list[str], cpus: float, gpus: int):
        import ray
        from ray.util.placement_group import placement_group

        if how not in PLACEMENTS:
            raise ValueError(f"bad Ray placement {how!r}: choose one of {', '.join(PLACEMENTS)}")
        self.how = how
        have = ray.cluster_resources()
        self.marked = {r for r in ROLES if have.get(role_resource(r), 0) > 0}
        self._free: dict[str, list[tuple]] = {}  # role -> (group, bundle index) not yet given out
        self.groups = []
        if how == "auto":
            return

        def bundle(role: str) -> dict:
            b = {"CPU": cpus} if not gpus else {"GPU": gpus, "CPU": 1}
            if role in self.marked:
                b[role_resource(role)] = ROLE_SLIVER
            return b

        if how == "pools":
            for role in dict.fromkeys(roles):
                n = roles.count(role)
                pg = placement_group([bundle(role)] * n, strategy="PACK")
                self.groups.append(pg)
                self._free[role] = [(pg, i) for i in range(n)]
        else:
            pg = placement_group([bundle(r) for r in roles], strategy=how.upper())
            self.groups.append(pg)
            for i, role in enumerate(roles):
                self._free.setdefault(role, []).append((pg, i))

    def options(self, role: str) -> dict:
        """Extra actor options for the next instance of ``role``: its bundle (while the groups have
        one left) and its hosts' mark."""
        opts: dict = {}
        if role in self.marked:
            opts["resources"] = {role_resource(role): ROLE_SLIVER}
        free = self._free.get(role)
        if free:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg, index = free.pop(0)
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        return opts

    def describe(self, role: str) -> str:
        """What an actor of ``role`` asks of placement, for an error that says why it waits ("":
        nothing beyond its resources)."""
        parts = [f"placement {self.how}"] if self.how != "auto" else []
        if role in self.marked:
            parts.append(f"hosts marked {role_resource(role)}")
        return ", ".join(parts)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - Ray already gone: nothing is held
                pass
        self.groups = []

