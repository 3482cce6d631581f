"""netemu: the emulated interconnect between prefill and decode instances.

- ``profiles``: ``LinkProfile`` (nvlink, roce, pcie/indirect), ``parse_link``, KV size emulation.
- ``link``: ``LinkModel``, pure bandwidth/latency/fair-sharing arithmetic on an injected clock.
- ``transfer``: ``KVLink``, the real block copy between pools plus the emulated wait.

Only ``transfer`` imports torch; its names load lazily so ``import netemu`` stays torch-free.
"""
from netemu.link import LinkModel
from netemu.profiles import (PROFILES, KVEmulation, LinkProfile, model_kv_bytes_per_token,
                             parse_link)

_TRANSFER_NAMES = ("KVLink", "TransferError", "TransferRecord", "block_nbytes", "copy_blocks")

__all__ = ["LinkModel", "PROFILES", "KVEmulation", "LinkProfile", "model_kv_bytes_per_token",
           "parse_link", *_TRANSFER_NAMES]


def __getattr__(name: str):
    if name in _TRANSFER_NAMES:
        from netemu import transfer
        return getattr(transfer, name)
    raise AttributeError(f"module 'netemu' has no attribute {name!r}")
