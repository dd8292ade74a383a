"""CUDA graphs for decode steps: on a GPU a small model's step is launch-bound (an H100 profile
of 16 requests showed 57 ms of GPU work in 1.1 s of CPU), so each decode batch size in a list
of buckets is captured once, at start-up, and a step replays the graph of the smallest bucket
that holds it, padded to that size. Prefill chunks and drafted requests stay eager.

A captured graph reads its inputs from fixed addresses: one int64 row per request, in a
device buffer a step overwrites with one copy from pinned host memory (`DecodeRows` lays the
rows out, in plain NumPy). Padding rows decode token 0 at position 0 into the first slot of a
block no request holds (`pad_block`, one past the pool), attending to that slot alone, so they
write nothing a real request reads. Sampling runs outside the graph, on its logits.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shoal.engine.step_layout import StepLayout
from shoal.layers.attention import AttentionMetadata
from shoal.models.llama import LlamaForCausalLM

# Columns of a request's row; its block table follows from TABLE on.
ID, POSITION, SLOT, SEQ_LEN, TABLE = range(5)


def graph_sizes(max_num_seqs: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The decode batch sizes to capture, ascending, none past `max_num_seqs`. By default 1, 2,
    4, then every multiple of 8 and `max_num_seqs` itself, so a step pads at most 7 rows."""
    if sizes is None:
        sizes = [1, 2, 4, *range(8, max_num_seqs + 1, 8), max_num_seqs]
    return sorted({s for s in sizes if 0 < s <= max_num_seqs})


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """Where a decode step's inputs go in the graphs' buffer: `sizes` (the buckets, ascending),
    `width` table entries a row (a sequence of `max_model_len` tokens' blocks), and the block
    padding rows write to."""

    sizes: list[int]
    width: int
    pad_block: int
    block_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.sizes[-1], TABLE + self.width

    def bucket(self, num_rows: int) -> int | None:
        """The smallest captured size holding `num_rows`; None past the largest."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, step: StepLayout) -> bool:
        """Whether a graph runs this step: decodes only, few enough, tables narrow enough."""
        return (
            step.decodes_only
            and self.bucket(step.num_decodes) is not None
            and all(len(t) <= self.width for t in step.decode_tables)
        )

    def fill(self, rows: np.ndarray, step: StepLayout | None = None) -> None:
        """Write the step's decodes into the first rows of `rows` (one bucket's worth) and pad
        the rest; no step pads them all (the rows graphs are captured with)."""
        n = 0 if step is None else step.num_decodes
        rows[n:] = 0
        rows[n:, SLOT] = self.pad_block * self.block_size
        rows[n:, SEQ_LEN] = 1
        rows[:, TABLE:] = self.pad_block  # entries past a request's last block
        if step is None or not n:
            return
        rows[:n, ID] = step.ids
        rows[:n, POSITION] = np.concatenate(step.positions)
        rows[:n, SLOT] = np.concatenate(step.slots)
        rows[:n, SEQ_LEN] = step.decode_lens
        for r, table in enumerate(step.decode_tables):
            rows[r, TABLE : TABLE + len(table)] = table


class DecodeGraphs:
    """One CUDA graph per bucket of `rows.sizes`, each computing the logits of every row of its
    bucket into the first rows of one shared buffer; captured when built (largest first,
    sharing one memory pool) and never again."""

    def __init__(self, model: LlamaForCausalLM, rows: DecodeRows, device: torch.device) -> None:
        self.model, self.rows = model, rows
        self._host = torch.zeros(rows.shape, dtype=torch.int64, pin_memory=True)
        self._device = torch.zeros(rows.shape, dtype=torch.int64, device=device)
        # The last copy out of the pinned rows; they are not rewritten before it is done.
        self._copied = torch.cuda.Event()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits = torch.empty(0)
        self._capture()

    def fits(self, step: StepLayout) -> bool:
        return self.rows.fits(step)

    def _forward(self, size: int) -> torch.Tensor:
        """The decode step of `size` rows over the device buffer, as the graphs capture it."""
        rows = self._device[:size]
        ids, positions, slots, seq_lens = (
            rows[:, c].contiguous() for c in (ID, POSITION, SLOT, SEQ_LEN)
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decodes=size,
            decode_block_tables=rows[:, TABLE:],
            decode_lens=seq_lens,
            prefills=[],
        )
        return self.model.compute_logits(self.model(ids, positions, meta))

    @torch.inference_mode()
    def _capture(self) -> None:
        self.rows.fill(self._host.numpy())
        self._device.copy_(self._host)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.rows.sizes):
            warm = self._forward(size)  # warm-up: compiles the kernels, sets up cuBLAS
            if not self._logits.numel():  # the largest bucket's: every graph writes into it
                self._logits = torch.empty_like(warm)
            del warm
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[:size].copy_(self._forward(size))
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, step: StepLayout) -> torch.Tensor:
        """The logits of each of the step's rows (and of its bucket's padding rows after them);
        valid until the next run."""
        size = self.rows.bucket(step.num_decodes)
        assert size is not None, "run only a step that fits"
        self._copied.synchronize()
        self.rows.fill(self._host.numpy()[:size], step)
        self._device[:size].copy_(self._host[:size], non_blocking=True)
        self._copied.record()
        self._graphs[size].replay()
        return self._logits[:size]
