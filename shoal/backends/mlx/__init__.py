"""The MLX backend (`pip install 'shoal[mlx]'`): design input 001's `BlockPoolBatchEngine`
around mlx-lm's `BatchGenerator`, on shoal's block pool, agent sessions and session files.

Importing it needs mlx and mlx-lm, not torch. On Linux an OpenBLAS, when one is found, is
loaded before MLX (see `blas.py`).
"""

from shoal.backends.mlx.blas import preload_openblas

BLAS = preload_openblas()

from shoal.backends.mlx.engine import BlockPoolBatchEngine  # noqa: E402  (after the BLAS preload)
from shoal.backends.mlx.kv import ModelCacheSpec  # noqa: E402
from shoal.backends.mlx.loader import MLXModel, load_gguf  # noqa: E402
from shoal.backends.mlx.outputs import AgentBlocks, CompletedGeneration  # noqa: E402

__all__ = [
    "BLAS",
    "AgentBlocks",
    "BlockPoolBatchEngine",
    "CompletedGeneration",
    "MLXModel",
    "ModelCacheSpec",
    "load_gguf",
]
