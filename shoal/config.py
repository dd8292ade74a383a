"""Engine configuration: one plain dataclass, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.errors import InvalidRequestError

if TYPE_CHECKING:
    from shoal.engine.grammar_worker import GrammarBudget

GiB = 1 << 30
MiB = 1 << 20
BACKENDS = ("torch", "mlx")


def cache_root() -> Path:
    """Where shoal keeps what it can rebuild (compiled kernels, GGUF metadata):
    `$SHOAL_CACHE_DIR`, default `~/.cache/shoal`."""
    return Path(os.environ.get("SHOAL_CACHE_DIR", "~/.cache/shoal")).expanduser()


@dataclass(slots=True)
class EngineConfig:
    """Limits of the batch (design input 000's BatchConstraints, vLLM's scheduler knobs).

    `kv_cache_bytes` is turned into a block count once the model's per-token KV size is known;
    `num_blocks` overrides it (tests use tiny pools to force preemption).

    `backend` picks the engine: "torch" (shoal's paged-attention engine) or "mlx" (design
    input 001's block pool around mlx-lm's `BatchGenerator`, `pip install 'shoal[mlx]'`; it
    loads .gguf files, runs on MLX's default device and has no cross-request prefix cache).
    """

    model: str | None = None
    backend: str = "torch"
    dtype: str = "float32"
    # Weights kept quantized in memory (`models/loader.py`): "gguf" keeps a GGUF's Q4_0, Q4_1
    # and Q8_0 blocks (Q4_K and Q6_K repacked into Q4_1 and Q8_0), "int8" quantizes to Q8_0
    # blocks at load; activations then run in float32 and the KV cache in `dtype`. CPU only.
    # Products quantize their float32 rows to `quantized_activations` blocks of 32: "int16"
    # precision (two int8 levels, within about 4e-5 of float) or "int8" (llama.cpp's, faster
    # at large batches, about 1% off where a model has outlier features; `layers/csrc/qtile.h`).
    quantization: str | None = None
    quantized_activations: str = "int16"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int = 2 * GiB
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    min_batch_size: int = 1
    batch_wait_s: float = 0.005
    enable_prefix_caching: bool = True
    max_waiting: int = 100_000
    # The KV store below the pool (`engine/block_store.py`): blocks the pool evicts go to host
    # memory (at most `host_kv_bytes`), then to disk (at most `disk_kv_bytes`) under
    # `cache_dir`, where they and the sessions' manifests survive restarts (else a private
    # temporary folder); each tier drops its least recently used blocks first.
    cache_dir: str | None = None
    host_kv_bytes: int = 2 * GiB
    disk_kv_bytes: int = 16 * GiB
    # A folder several engines share (replicas of a cluster; the next run after a crash): each
    # finished turn's session KV is written behind there, and blocks this engine lacks are read
    # from there (`engine/shared_tier.py`).
    session_tier_dir: str | None = None
    # Speculation by prompt lookup for greedy requests (`engine/ngram.py`; vLLM's "ngram"
    # method): up to this many draft tokens a step, matched on the last `prompt_lookup_max`
    # down to `prompt_lookup_min` tokens. 0 turns it off.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # Structured-output grammars (`engine/structured.py`, `engine/grammar_pool.py`): a new
    # constraint is first compiled by one of `grammar_workers` killable processes, within
    # `grammar_compile_timeout_s` and `grammar_compile_bytes` (or refused), then for use here;
    # a request waits at most `grammar_wait_s` for its grammar. Compiled grammars are cached up
    # to `grammar_cache_bytes`.
    grammar_workers: int = 2
    grammar_compile_timeout_s: float = 20.0
    grammar_compile_bytes: int = 1024 * MiB
    grammar_wait_s: float = 60.0
    grammar_cache_bytes: int = 256 * MiB
    # CUDA graphs for decode steps (`engine/cuda_graphs.py`): on CUDA one graph per batch size
    # in `cuda_graph_sizes` (default: 1, 2, 4, then multiples of 8 up to `max_num_seqs`) is
    # captured at start-up; `enforce_eager` runs every step eagerly. Off CUDA both are ignored.
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None

    def grammar_budget(self) -> GrammarBudget:
        from shoal.engine.grammar_worker import GrammarBudget

        return GrammarBudget(
            workers=self.grammar_workers,
            timeout_s=self.grammar_compile_timeout_s,
            memory_bytes=self.grammar_compile_bytes,
            wait_s=self.grammar_wait_s,
        )

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidRequestError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.block_size <= 0:
            raise InvalidRequestError("block_size must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise InvalidRequestError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.min_batch_size < 1 or self.batch_wait_s < 0:
            raise InvalidRequestError("min_batch_size must be >= 1 and batch_wait_s >= 0")
        if self.host_kv_bytes < 0 or self.disk_kv_bytes < 0:
            raise InvalidRequestError("host_kv_bytes and disk_kv_bytes must be >= 0")
        if self.dtype not in ("float32", "float64", "float16", "bfloat16"):
            raise InvalidRequestError(f"unsupported dtype {self.dtype!r}")
        if self.quantization not in (None, "gguf", "int8"):
            raise InvalidRequestError(
                f'quantization must be "gguf", "int8" or None, got {self.quantization!r}'
            )
        if self.quantized_activations not in ("int16", "int8"):
            got = self.quantized_activations
            raise InvalidRequestError(
                f'quantized_activations must be "int16" or "int8", got {got!r}'
            )
        if self.quantization is not None and (self.backend != "torch" or self.device != "cpu"):
            raise InvalidRequestError("quantization needs the torch backend on the CPU")
        if self.num_speculative_tokens < 0:
            raise InvalidRequestError("num_speculative_tokens must be >= 0")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.num_speculative_tokens and self.backend != "torch":
            raise InvalidRequestError("num_speculative_tokens needs the torch backend")
        if self.cuda_graph_sizes is not None and not all(
            0 < n <= self.max_num_seqs for n in self.cuda_graph_sizes
        ):
            raise InvalidRequestError("cuda_graph_sizes must be in [1, max_num_seqs]")
        if self.grammar_cache_bytes < 0:
            raise InvalidRequestError("grammar_cache_bytes must be >= 0")
        self.grammar_budget()  # checks the compile budget
