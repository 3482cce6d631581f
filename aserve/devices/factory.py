"""What an engine config's ``device`` means: the loaded model and the device each instance gets.

    cpu | cuda[:i]  -> ModelBundle.load (weights, tokenizer) and a TorchDevice per instance
    sim:PROFILE     -> the simulated model's shape (no weights; the served model's tokenizer for
                       prompts) and a SimDevice per instance (aserve/devices/sim_device.py)
    --cluster ray   -> the same, each in a Ray actor of its own (RayDevice, aserve/devices/ray_device.py)

``DeviceFactory`` is the one place that makes the choice: a cluster asks it for each instance's
device and never looks at which kind it got; it owns the Ray connection (made at ``start``,
dropped at ``close``) and knows how many cores there are to share.
"""
from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
from typing import Optional

from aserve.config import ClusterConfig, EngineConfig
from aserve.engine.bundle import ModelBundle
from aserve.devices.device import CoreShare, Device
from aserve.devices.sim_device import SimDevice, SimProfile, load_profile
from aserve.devices.torch_device import TorchDevice


def is_sim(cfg: EngineConfig) -> bool:
    return cfg.device.startswith("sim:")


def model_args(cfg: EngineConfig):
    """The served (or simulated) model's shape, without loading any weights."""
    from model.config import ModelArgs
    from model.loader import read_config, resolve_model

    simulated = _simulated_args(cfg)
    return simulated or ModelArgs.from_hf(read_config(resolve_model(cfg.model, _cache(cfg))))


def device_cost(cfg: EngineConfig, threads: int):
    """The step costs of ``cfg``'s device at ``threads``: a simulated profile's, or this machine's
    measured engine (measured now, once, if never before)."""
    if is_sim(cfg):
        return _profile(cfg.device.removeprefix("sim:"), cfg, threads).cost
    from aserve.profiles.device_profile import load_or_measure

    return load_or_measure(cfg, threads)


def load_bundle(cfg: EngineConfig, weights: bool = True) -> ModelBundle:
    """The model a cluster of ``cfg`` serves: loaded weights, or a simulated model's shape.
    ``weights=False``: the shape and tokenizer only (a Ray driver: each actor loads the weights)."""
    if not is_sim(cfg):
        return ModelBundle.load(cfg, weights=weights)
    import torch
    from transformers import AutoTokenizer

    from model.loader import pick_dtype, resolve_model

    path = resolve_model(cfg.model, _cache(cfg))
    simulated = _simulated_args(cfg)
    dtype = torch.float16 if simulated else pick_dtype(cfg.dtype, "cpu")
    return ModelBundle(path, model_args(cfg), None, AutoTokenizer.from_pretrained(path), dtype, cfg.device)


def _cache(cfg: EngineConfig) -> Optional[Path]:
    return Path(cfg.cache_dir) if cfg.cache_dir else None


def _simulated_args(cfg: EngineConfig):
    """A simulated profile's own model, or None (real devices, and sim:local serves the real model)."""
    spec = cfg.device.removeprefix("sim:")
    if not is_sim(cfg) or spec == "local":
        return None
    return _shipped_or_file(spec).model_args()


def make_device(name: str, bundle: ModelBundle, cfg: EngineConfig, num_threads: int,
                share: Optional[CoreShare] = None) -> Device:
    if not is_sim(cfg):
        return TorchDevice(name, bundle, cfg, num_threads, share)
    profile = _profile(cfg.device.removeprefix("sim:"), cfg, num_threads)
    args = bundle.args
    token_bytes = 2 * args.num_layers * args.num_kv_heads * args.head_dim * bundle.dtype.itemsize
    block_bytes = token_bytes * cfg.block_size
    kv_bytes = profile.kv_capacity_bytes or int(cfg.kv_cache_gb * 2**30)
    host_bytes = profile.host_swap_bytes or max(1, int(cfg.swap_gb * 2**30))
    return SimDevice(name, profile, cfg.block_size, kv_bytes // block_bytes, max(1, host_bytes // block_bytes),
                     token_bytes, _plain_token(bundle), share)


def _profile(spec: str, cfg: EngineConfig, threads: Optional[int]) -> SimProfile:
    """The profile ``sim:spec`` names, for instances of ``cfg`` at ``threads`` torch threads
    each. A measured file is checked against them (aserve/profiles/profile_check.py): refused
    where it was measured for another engine, warned about where it is old, of another machine
    or was measured busy; ``sim:local`` is measured for them if the cached one is not."""
    if spec != "local":
        profile = _shipped_or_file(spec)
        if profile.measured:
            _check_measured(f"sim:{spec}", profile.cost.meta, cfg, threads or 1, spec)
        return profile
    from aserve.profiles.device_profile import load_or_measure

    real = EngineConfig(model=cfg.model, dtype=cfg.dtype, attention=cfg.attention, kernels=cfg.kernels,
                        block_size=cfg.block_size, cache_dir=cfg.cache_dir)  # the cpu this simulation stands for
    return load_profile("local", load_or_measure(real, threads or 1))


def _check_measured(name: str, meta: dict, cfg: EngineConfig, threads: int, path: str) -> None:
    from aserve.profiles import profile_check
    from aserve.profiles.machine import cpu_flags, machine

    here = machine()
    wanted = profile_check.instance_fields(cfg, threads, meta, same_machine=meta.get("machine", here) == here)
    profile_check.check(name, meta, wanted, profile_check.measure_command(cfg, threads, path),
                        cfg.allow_profile_mismatch, here, cpu_flags())


@functools.lru_cache(maxsize=16)
def _shipped_or_file(spec: str) -> SimProfile:
    return load_profile(spec)


def _plain_token(bundle: ModelBundle) -> int:
    """A token id that ends nothing (no end-of-sequence or special id), for simulated samples."""
    special = set(getattr(bundle.tokenizer, "all_special_ids", []) or []) | set(bundle.eos_token_ids)
    return next(i for i in range(100, bundle.args.vocab_size) if i not in special)


class DeviceFactory:
    """Devices for one cluster's instances: of this process (a ``TorchDevice`` thread, or a
    ``SimDevice``), or Ray actors (``RayDevice``), each asking Ray for its share of the cluster's
    CPUs (of the instances planned, or of all live ones plus itself) or for one GPU."""

    def __init__(self, engine: EngineConfig, cfg: ClusterConfig):
        self.engine, self.cfg = engine, cfg
        self.bundle: Optional[ModelBundle] = None
        self._ray_cpus: Optional[int] = None  # the Ray cluster's CPUs, once connected (backend ray)
        self._owns_ray = False  # this factory connected to Ray, and disconnects at close
        self._placement = None  # backend ray: the placement groups and role marks (ray_placement.Placement)

    @property
    def local(self) -> bool:
        return self.cfg.backend == "local"

    def start(self, bundle: ModelBundle, roles: list[str]) -> None:
        """Before the first device: the model every local device shares; for Ray, the connection
        and the placement of the ``roles`` the cluster starts with."""
        self.bundle = bundle
        if not self.local:
            from aserve.devices import ray_runtime
            from aserve.devices.ray_placement import Placement

            self._owns_ray = ray_runtime.connect(self.cfg.ray_address)
            self._ray_cpus = ray_runtime.total_cpus()
            gpus = 0 if self.engine.device == "cpu" else 1
            self._placement = Placement(self.cfg.ray_placement, roles, self._cpus_each(len(roles), 0), gpus)

    def _cpus_each(self, planned: int, live: int) -> float:
        return self.cores() / max(planned, live + 1)

    def close(self) -> None:
        if self._placement is not None:
            self._placement.close()
            self._placement = None
        if self._owns_ray:
            from aserve.devices import ray_runtime

            ray_runtime.disconnect()
            self._owns_ray = False

    def cores(self) -> int:
        """Torch threads to share between instances: ``--threads``, else every core there is (this
        machine's, or the Ray cluster's once connected)."""
        return self.engine.num_threads or self._ray_cpus or os.cpu_count() or 1

    def make(self, instance_id: str, role: str, num_threads: int, share: CoreShare, planned: int, live: int) -> Device:
        """The device of one instance of ``role``. ``planned``: instances the cluster starts with;
        ``live``: those neither failed nor removed now (a Ray actor's CPU share is of the larger)."""
        if self.local:
            return make_device(instance_id, self.bundle, self.engine, num_threads, share)
        from aserve.devices.ray_device import RayDevice

        return RayDevice(instance_id, self.engine, self.bundle, num_threads, self._cpus_each(planned, live),
                         self.cfg.lease_s, self.cfg.actor_start_timeout_s, self.cfg.ray_kv,
                         self._placement.options(role), self._placement.describe(role))

    async def build(self, instance_id: str, role: str, num_threads: int, share: CoreShare, planned: int,
                    live: int) -> Device:
        """``make`` for an instance added while the cluster serves: a device of this process is
        built on a worker thread (its KV pool is gigabytes of zeros; on CUDA its graphs are
        captured), so no stream waits for it; a simulated one is cheap and lives on virtual time,
        a Ray actor starts on its own."""
        if not self.local or is_sim(self.engine):
            return self.make(instance_id, role, num_threads, share, planned, live)
        return await asyncio.to_thread(self.make, instance_id, role, num_threads, share, planned, live)
