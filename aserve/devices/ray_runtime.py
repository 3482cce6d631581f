"""Connecting this process to Ray: join a running cluster, or start a local one sized to this
machine. Only the command line's ``--cluster ray[:ADDRESS]`` (``ClusterConfig.backend``) leads
here; nothing imports Ray otherwise.

    ray start --head                      # on the first host (prints its ADDRESS)
    ray start --address ADDRESS           # on every other host
    aserve serve --cluster ray:ADDRESS    # on any host of the cluster: the driver
    aserve serve --cluster ray            # no cluster: a local Ray with this machine's cores
"""
from __future__ import annotations

import logging
import os
from typing import Optional


def connect(address: Optional[str]) -> bool:
    """Use the Ray this process already has (a test session's, a command's), join the cluster at
    ``address`` ("auto": the one started on this host), or start a local Ray with every core of
    this machine. True when this call connected: the caller disconnects when done."""
    import ray

    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.WARNING, "configure_logging": True}
    if address:
        ray.init(address=address, **quiet)
    else:
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, **quiet)
    return True


def disconnect() -> None:
    import ray

    ray.shutdown()


def local_nodes(n: int):
    """A local Ray of ``n`` nodes on this machine (Ray's multi-node harness: a raylet and an object
    store each), this machine's cores split between them; ``.address`` to join, ``.shutdown()``."""
    from ray.cluster_utils import Cluster

    cpus = max(1, (os.cpu_count() or 1) // n)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    for _ in range(n - 1):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    return cluster


def total_cpus() -> int:
    """CPUs of the whole Ray cluster (every host's), at least 1."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))
