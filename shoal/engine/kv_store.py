"""The torch side of the KV store: whole pool blocks to bytes and back (`BlockCodec`).

A block's payload is one uint8 buffer `[layers x {k, v}, block bytes]`: every layer's key and
value rows of that block, in order. On the CPU one C++ call (`blocks.cpp`) copies any set of
blocks, wherever they lie in the pool, into or out of their own buffers; elsewhere (CUDA, no
compiler) torch indexing does the same. `BlockStore` decides what moves and when.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from shoal.engine.host_tier import Payload
from shoal.layers import cpu_kernels

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class BlockSource(Protocol):
    """The part of `ModelRunner` the codec needs."""

    def kv_caches(self) -> KVCaches: ...

    def copy_block(self, src: int, dst: int) -> None: ...


def _flat(caches: KVCaches) -> list[torch.Tensor]:
    return [c for pair in caches for c in pair]


class TorchBlockCodec:
    """`BlockCodec` over the model runner's KV caches."""

    def __init__(self, runner: BlockSource) -> None:
        self.runner = runner
        first = runner.kv_caches()[0][0]
        self.block_nbytes = 2 * len(runner.kv_caches()) * first[0].numel() * first.element_size()

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> list[Payload]:
        caches = _flat(self.runner.kv_caches())
        kernels = cpu_kernels.for_tensor(caches[0])
        if kernels is not None:
            blocks = kernels.gather_blocks(caches, torch.tensor(block_ids))
        else:
            blocks = [
                torch.cat([c[b].reshape(-1).view(torch.uint8) for c in caches]).cpu()
                for b in block_ids
            ]
        return [t.numpy() for t in blocks]

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], payloads: list[Payload]) -> None:
        caches = _flat(self.runner.kv_caches())
        arrays = [np.frombuffer(p, dtype=np.uint8) for p in payloads]  # views, no copy
        assert all(a.nbytes == self.block_nbytes for a in arrays)
        kernels = cpu_kernels.for_tensor(caches[0])
        if kernels is not None:
            srcs = [int(a.ctypes.data) for a in arrays]
            kernels.scatter_blocks(srcs, caches, torch.tensor(block_ids))
            return
        step = self.block_nbytes // len(caches)
        for b, a in zip(block_ids, arrays, strict=True):
            data = torch.from_numpy(a.copy())
            for i, c in enumerate(caches):
                chunk = data[i * step : (i + 1) * step].view(c.dtype).view(c[b].shape)
                c[b].copy_(chunk)

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.copy_block(src, dst)
