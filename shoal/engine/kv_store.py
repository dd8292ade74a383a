"""Moves session KV between the torch block pool and the disk tier (`session_files`).

`SessionStore` implements `SessionIO` for the session manager: it copies blocks, gathers a
session's blocks into one safetensors tensor `[layers, 2, blocks, block_size, kv_heads,
head_dim]` for `SessionFiles`, and scatters a validated file back into freshly allocated blocks.
It holds no session state: the `SessionManager` decides what to save, restore and forget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from shoal.engine.session_files import FilesTier, KVLayout, SessionFiles
from shoal.layers import cpu_kernels

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class BlockSource(Protocol):
    """The part of `ModelRunner` the store needs."""

    def kv_caches(self) -> KVCaches: ...

    def copy_block(self, src: int, dst: int) -> None: ...


def _flat(caches: KVCaches) -> list[torch.Tensor]:
    return [c for pair in caches for c in pair]


@torch.inference_mode()
def gather_blocks(caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """KV of `block_ids` in every layer, `[layers, 2, blocks, ...]`, on the CPU."""
    kernels = cpu_kernels.for_tensor(caches[0][0])
    if kernels is not None:
        out = kernels.gather_blocks(_flat(caches), torch.tensor(block_ids))
        return out.view(len(caches), 2, *out.shape[1:])
    idx = torch.tensor(block_ids, device=caches[0][0].device)
    return torch.stack([torch.stack((k[idx], v[idx])) for k, v in caches]).cpu()


@torch.inference_mode()
def scatter_blocks(caches: KVCaches, block_ids: list[int], kv: torch.Tensor) -> None:
    """Write `kv` (from `gather_blocks`) into `block_ids` of every layer: on the CPU, one C++
    call copies every block wherever it lies; elsewhere one indexed write per cache."""
    kernels = cpu_kernels.for_tensor(caches[0][0])
    if kernels is not None:
        kernels.scatter_blocks(kv.contiguous(), _flat(caches), torch.tensor(block_ids))
        return
    idx = torch.tensor(block_ids, device=caches[0][0].device)
    kv = kv.to(caches[0][0].device)
    for i, (k, v) in enumerate(caches):
        k[idx] = kv[i, 0]
        v[idx] = kv[i, 1]


class SessionStore(FilesTier):
    """`SessionIO` over the runner's KV caches and the session files; also the codec the shared
    session tier (`session_tier.KVCodec`) moves its bytes with."""

    def __init__(self, runner: BlockSource, layout: KVLayout, cache_dir: str | Path | None) -> None:
        self.runner = runner
        self.files = SessionFiles(layout, cache_dir)

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.copy_block(src, dst)

    def save(
        self, session_id: str, token_ids: list[int], block_ids: list[int], last_used: float
    ) -> bool:
        shape, data = self.encode(self.snapshot(block_ids))
        return self.files.write(session_id, token_ids, last_used, shape, data)

    def load(self, session_id: str, token_ids: list[int]) -> torch.Tensor | None:
        """The session's KV from disk, validated; None (file discarded, warned) if unusable."""
        return self.files.load(session_id, token_ids, self.read, self.describe)

    # -- the codec of the shared tier ----------------------------------------------------
    def snapshot(self, block_ids: list[int]) -> torch.Tensor:
        """A CPU copy of the blocks' KV, so the pool may reuse them at once."""
        return gather_blocks(self.runner.kv_caches(), block_ids).contiguous()

    def encode(self, kv: torch.Tensor) -> tuple[list[int], bytes]:
        return list(kv.shape), save_tensors({"kv": kv})

    def nbytes(self, kv: torch.Tensor) -> int:
        return kv.numel() * kv.element_size()

    def read(self, path: Path) -> torch.Tensor:
        with safe_open(path, framework="pt") as st:
            return st.get_tensor("kv")

    def describe(self, kv: torch.Tensor) -> tuple[list[int], str]:
        return list(kv.shape), str(kv.dtype).removeprefix("torch.")

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # along the blocks

    def restore(self, data: torch.Tensor, block_ids: list[int]) -> None:
        scatter_blocks(self.runner.kv_caches(), block_ids, data)
