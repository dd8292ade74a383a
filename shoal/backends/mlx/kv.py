"""Agent KV behind the shared block pool: which MLX arrays hold each pool block.

MLX has no paged attention: `BatchGenerator` runs on dense, left-padded caches. So the pool is
bookkeeping (the same `BlockPool`, `SessionManager` and KV store as the torch engine) and
the bytes live in *slabs*: the per-layer `[1, kv_heads, tokens, head_dim]` arrays that a
finished request's cache already is. A pool block names a 256-token run of a slab. Turning a
cache into blocks is therefore free (no copy), and reconstructing a cache from the blocks of
one slab hands MLX views, also free; only blocks from different slabs (rare: a partial block
copied on write) are concatenated. MLX arrays are immutable values, so sharing a slab between
blocks, or with a running batch, never lets one writer change another's KV.

`BlockData` is also the store's `BlockCodec`: a block's bytes are each layer's key then value
rows `[kv_heads, block tokens, head_dim]` (zero past a slab's end), so blocks go down to host
memory, disk and the shared folder, and come back as one-block slabs, like the torch engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from shoal.engine.block_files import KVLayout
from shoal.engine.block_pool import BlockPool, cdiv
from shoal.engine.host_tier import Payload
from shoal.errors import CacheCorruptionError, InvalidRequestError

Layers = list[tuple[mx.array, mx.array]]  # per layer (keys, values), each [1, H, T, D]


def dtype_name(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


@dataclass(slots=True, frozen=True)
class ModelCacheSpec:
    """The KV geometry of a model: what every block of every agent must match."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    fingerprint: str
    block_tokens: int = 256

    @classmethod
    def from_model(cls, model: Any, fingerprint: str, block_tokens: int = 256) -> ModelCacheSpec:
        caches = model.make_cache() if hasattr(model, "make_cache") else []
        if not caches or any(type(c) is not KVCache for c in caches):
            raise InvalidRequestError("the MLX block pool needs a model with full-attention layers")
        attn = model.layers[0].self_attn
        dtype = dtype_name(model.model.norm.weight)
        if dtype not in ("float32", "float16"):
            raise InvalidRequestError(f"the MLX block pool stores float32 or float16, not {dtype}")
        return cls(len(caches), attn.n_kv_heads, attn.head_dim, dtype, fingerprint, block_tokens)

    @property
    def bytes_per_block(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.kv_heads * self.block_tokens * self.head_dim * itemsize

    def layout(self) -> KVLayout:
        return KVLayout(
            self.fingerprint,
            self.dtype,
            self.block_tokens,
            self.num_layers,
            self.kv_heads,
            self.head_dim,
        )

    def check(self, layers: Layers, num_tokens: int) -> None:
        """Raise `CacheCorruptionError` unless `layers` hold `num_tokens` tokens of this model."""
        if len(layers) != self.num_layers:
            raise CacheCorruptionError(f"{len(layers)} layers, the model has {self.num_layers}")
        want = (1, self.kv_heads, self.head_dim)
        for k, v in layers:
            for a in (k, v):
                shape = (a.shape[0], a.shape[1], a.shape[3]) if a.ndim == 4 else ()
                if shape != want or a.shape[2] < num_tokens or dtype_name(a) != self.dtype:
                    raise CacheCorruptionError(
                        f"KV {a.dtype} {a.shape} does not match {self.dtype} {want} "
                        f"for {num_tokens} tokens"
                    )


@dataclass(slots=True, eq=False)
class Slab:
    layers: Layers
    num_tokens: int


def as_caches(layers: Layers, num_tokens: int) -> list[KVCache]:
    """mlx-lm caches over `layers` (views, no copy) holding their first `num_tokens` tokens."""
    caches = []
    for k, v in layers:
        c = KVCache()
        c.keys, c.values, c.offset = k[:, :, :num_tokens], v[:, :, :num_tokens], num_tokens
        caches.append(c)
    return caches


class BlockData:
    """Pool block → (slab, index) for the MLX backend, and its `BlockCodec`."""

    def __init__(self, spec: ModelCacheSpec) -> None:
        self.spec = spec
        self.block_nbytes = spec.bytes_per_block
        self._blocks: dict[int, tuple[Slab, int]] = {}

    # -- cache <-> blocks ------------------------------------------------------------------
    def put(self, block_ids: list[int], layers: Layers, num_tokens: int) -> None:
        """Make `block_ids` hold the first `num_tokens` tokens of `layers` (no copy)."""
        slab = Slab(layers, num_tokens)
        for i, b in enumerate(block_ids[: cdiv(num_tokens, self.spec.block_tokens)]):
            self._blocks[b] = (slab, i)

    def gather(self, block_ids: list[int], num_tokens: int) -> Layers:
        """Per-layer KV of the first `num_tokens` tokens held by `block_ids`.

        Blocks that are consecutive runs of one slab come back as views; anything else is
        concatenated once here. Raises `CacheCorruptionError` if a block holds nothing.
        """
        bt = self.spec.block_tokens
        runs: list[tuple[Slab, int, int]] = []  # slab, first block, blocks
        for b in block_ids[: cdiv(num_tokens, bt)]:
            if b not in self._blocks:
                raise CacheCorruptionError(f"KV block {b} holds no data")
            slab, i = self._blocks[b]
            if runs and runs[-1][0] is slab and runs[-1][1] + runs[-1][2] == i:
                runs[-1] = (slab, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((slab, i, 1))
        if len(runs) == 1 and runs[0][1] == 0 and runs[0][0].num_tokens >= num_tokens:
            return [(k[:, :, :num_tokens], v[:, :, :num_tokens]) for k, v in runs[0][0].layers]
        out: Layers = []
        for layer in range(self.spec.num_layers):
            parts = [
                [a[:, :, i * bt : (i + n) * bt] for a in slab.layers[layer]] for slab, i, n in runs
            ]
            k = mx.concatenate([p[0] for p in parts], axis=2)[:, :, :num_tokens]
            v = mx.concatenate([p[1] for p in parts], axis=2)[:, :, :num_tokens]
            out.append((k, v))
        mx.eval(out)
        if out[0][0].shape[2] < num_tokens:
            raise CacheCorruptionError(f"blocks hold {out[0][0].shape[2]} of {num_tokens} tokens")
        return out

    def sweep(self, pool: BlockPool) -> None:
        """Forget the data of free blocks nothing can find again (not cached under a hash),
        so their slabs can be freed; cached ones keep theirs until the pool demotes them."""
        for b in [b for b in self._blocks if pool.blocks[b].ref_cnt == 0]:
            if pool.blocks[b].hash is None:
                del self._blocks[b]

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    # -- BlockCodec: byte moves ---------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        self._blocks[dst] = self._blocks[src]  # immutable arrays: sharing is copying

    def read_blocks(self, block_ids: list[int]) -> list[Payload]:
        bt = self.spec.block_tokens
        out = []
        for b in block_ids:
            if b not in self._blocks:
                raise CacheCorruptionError(f"KV block {b} holds no data")
            slab, i = self._blocks[b]
            rows = []
            for k, v in slab.layers:
                for a in (k, v):
                    part = a[0, :, i * bt : (i + 1) * bt]
                    if part.shape[1] < bt:
                        part = mx.pad(part, [(0, 0), (0, bt - part.shape[1]), (0, 0)])
                    rows.append(part.reshape(-1))
            out.append(np.array(mx.concatenate(rows)).view(np.uint8))
        return out

    def write_blocks(self, block_ids: list[int], payloads: list[Payload]) -> None:
        spec, bt = self.spec, self.spec.block_tokens
        shape = (1, spec.kv_heads, bt, spec.head_dim)
        for b, payload in zip(block_ids, payloads, strict=True):
            flat = mx.array(np.frombuffer(payload, dtype=spec.dtype))
            parts = flat.reshape(spec.num_layers, 2, -1)
            layers = [
                (parts[i, 0].reshape(shape), parts[i, 1].reshape(shape))
                for i in range(spec.num_layers)
            ]
            mx.eval(layers)
            self.put([b], layers, bt)
