"""A simulated device: a step takes its cost model's time on the loop's clock; no tensors.

    Instance ──StepPlan──► SimDevice.execute: t = cost.plan_s(plan) x (1 + contention if a
                           neighbour on the same bus is stepping) [x the speed trace's factor for
                           the window it starts in, if the profile has one]; await sleep(t); a token
                           for every row that samples one (replays end each request at its trace length)

``--device sim:PROFILE`` picks the profile:

- ``sim:opt-13b-v100-32gb`` (shipped, aserve/profiles/sim_profiles/): a model and a GPU from
  public figures, with the efficiency factors stated and justified in the file; KV capacity from
  the GPU's memory less the weights; its own model's shape (OPT-13B: 819,200 B of KV a token).
- ``sim:llama3-8b-h100-80gb`` (shipped): Llama-3-8B in bf16 on one H100 SXM5 80GB, the same way
  (131,072 B of KV a token).
- ``sim:local``: this machine's measured engine (``aserve profile device`` at the instances'
  threads) and the served model; KV capacity from ``--kv-cache-gb``, as a real instance's.
- ``sim:FILE.json``: a cost model file (``aserve profile device --out``) like ``local``, or a
  hardware file shaped like the shipped ones. A measured one (``local`` too) is checked against
  the instances it times (aserve/devices/factory.py, aserve/profiles/profile_check.py).

On the virtual-time loop (aserve/devices/virtual_time.py) a replay runs as fast as the host
computes the schedules; on a normal loop the sleeps pace it to wall time.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from aserve.profiles.cost_model import CostModel
from aserve.devices.device import CoreShare, Device
from model.config import ModelArgs
from scheduling.step import StepOutput, StepPlan

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles" / "sim_profiles"  # shipped with the cost model
GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class SimProfile:
    """What a simulated device is: its step costs, KV capacity and (optionally) its own model."""

    name: str
    cost: CostModel
    model: Optional[dict] = None  # an HF-style config of the simulated model; None: the served model
    kv_capacity_bytes: Optional[int] = None  # None: --kv-cache-gb, as a real instance
    host_swap_bytes: Optional[int] = None  # None: --swap-gb
    about: str = ""
    measured: bool = False  # a cost model measured on a machine (aserve profile device): checked against its instances

    def model_args(self) -> Optional[ModelArgs]:
        return ModelArgs.from_hf(self.model) if self.model else None


def hardware_cost(spec: dict) -> tuple[CostModel, int]:
    """A profile file's step costs from its hardware figures and efficiencies (and the KV bytes
    it leaves), by the roofline: a step reads every weight once and multiplies every row through
    every weight; prompt attention costs 4 x hidden FLOPs per query-key pair per layer; a decode
    row reads its context's KV. ``embedding_params`` (optional, 0 when absent) are the input
    embedding's: a lookup, neither read whole nor multiplied by a step, but held in memory (a
    fifteenth of Llama-3-8B's, whose LM head is a matrix of its own)."""
    hw, eff = spec["hardware"], spec["efficiency"]
    args = ModelArgs.from_hf(spec["model"])
    weight_bytes = spec["num_params"] * spec["dtype_bytes"]
    matmul_params = spec["num_params"] - spec.get("embedding_params", 0)
    read_s = matmul_params * spec["dtype_bytes"] / (hw["memory_bytes_per_s"] * eff["memory_read"])
    row_s = 2 * matmul_params / (hw["peak_flops"] * eff["gemm"])
    linear = tuple(eff["step_overhead_s"] + read_s + n * row_s for n in GRID)
    pair_s = 4 * args.hidden_size * args.num_layers / (hw["peak_flops"] * eff["attention"])
    kv_token_s = args.kv_bytes_per_token / (hw["memory_bytes_per_s"] * eff["memory_read"])
    kv_bytes = int(hw["memory_bytes"] * eff["memory_usable"] - weight_bytes - eff["activation_reserve_bytes"])
    if kv_bytes <= 0:
        raise ValueError(f"sim profile {spec.get('name')!r}: the weights leave no memory for KV")
    cost = CostModel(GRID, linear, pair_s, kv_token_s, float(spec.get("contention", 0.0)),
                     meta={"machine": hw["name"], "derived_from": "hardware figures"})
    return cost, kv_bytes


def load_profile(spec: str, local: Optional[CostModel] = None) -> SimProfile:
    """``spec`` after ``sim:``: a shipped profile's name, ``local`` (``local`` is this machine's
    measured cost model, passed in), or a JSON file."""
    if spec == "local":
        if local is None:
            raise ValueError("sim:local needs this machine's profile (aserve profile device)")
        return SimProfile("local", local, about="this machine's measured engine", measured=True)
    path = Path(spec) if spec.endswith(".json") else PROFILE_DIR / f"{spec}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
        raise ValueError(f"bad --device sim:{spec}: no such profile; known: {known}, local, or a .json file")
    data = json.loads(path.read_text())
    if "tokens" in data:  # a measured cost model (aserve profile device --out)
        return SimProfile(path.stem, CostModel.from_json(data), about=f"measured: {data.get('meta', {})}",
                          measured=True)
    cost, kv_bytes = hardware_cost(data)
    return SimProfile(data.get("name", path.stem), cost, data["model"], kv_bytes,
                      data["hardware"].get("host_swap_bytes"), data.get("about", ""))


class SimDevice(Device):
    """One simulated instance device. ``share.busy`` names the devices stepping right now (their
    bus is shared: a step beside a busy neighbour costs ``1 + contention`` times as much)."""

    def __init__(self, name: str, profile: SimProfile, block_size: int, num_blocks: int, num_host_blocks: int,
                 kv_bytes_per_token: int, token_id: int, share: Optional[CoreShare] = None):
        super().__init__()
        if num_blocks < 1:
            raise ValueError(f"sim:{profile.name}: no room for a KV block")
        self.name, self.profile, self.kind = name, profile, f"sim:{profile.name}"
        self.block_size, self.num_blocks = block_size, num_blocks
        self._num_host_blocks, self.kv_bytes_per_token = num_host_blocks, kv_bytes_per_token
        self.token_id = token_id  # what every sampled row returns: never an end-of-sequence id
        self.share = share or CoreShare()
        self.num_steps = 0

    async def _execute(self, plan: StepPlan) -> StepOutput:
        busy = self.share.busy
        neighbours = len(busy) - (self.name in busy)
        cost = self.profile.cost
        seconds = cost.plan_s(plan, neighbours)
        if cost.speed_trace:  # the logged run's speed in this step's window, counted from the first step
            now = asyncio.get_running_loop().time()
            if self.share.first_step_at is None:
                self.share.first_step_at = now
            seconds *= cost.speed_at(now - self.share.first_step_at)
        self.share.busy.add(self.name)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.share.busy.discard(self.name)
        self.num_steps += 1
        sampled = {s.request_id: self.token_id for s in plan.seqs if s.sampling is not None}
        return StepOutput(sampled, num_tokens=plan.num_real_tokens + plan.num_pad_tokens, forward_s=seconds,
                          busy_s=seconds)

    def add_swap_space(self) -> int:
        return self._num_host_blocks

    async def send_kv(self, request_id: str, block_ids: Sequence[int], dst: Device, dst_block_ids: Sequence[int],
                      link, num_tokens: int):
        """No bytes move: the link model alone times the transfer of this model's KV."""
        return await link.emulate(request_id, num_tokens, num_tokens * self.kv_bytes_per_token)

    async def close(self) -> None:
        pass
