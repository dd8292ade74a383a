"""How a scheduled batch becomes one flat row of tokens on the host (plain NumPy, no torch):
single-token decodes first, so they share one batched attention call, then prefill chunks
(and requests carrying draft tokens, which run as chunks). The runner turns a layout into
tensors for an eager step, or into a captured CUDA graph's input rows (`cuda_graphs.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shoal.engine.scheduler import ScheduledBatch
from shoal.engine.sequence import Sequence


@dataclass(slots=True)
class StepLayout:
    ids: list[int] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)  # flat cache slot of each new token
    decode_tables: list[np.ndarray] = field(default_factory=list)  # blocks each decode reads
    decode_lens: list[int] = field(default_factory=list)  # tokens each decode attends to
    # (q_start, q_len, context_len) of each prefill chunk, and the blocks covering its context.
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    prefill_tables: list[np.ndarray] = field(default_factory=list)
    # Rows whose logits are needed: the last row of each sequence that reached its end
    # (`sampled`), then every row of each sequence that carried drafts (`drafted`).
    logit_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)
    drafted: list[Sequence] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_lens)

    @property
    def decodes_only(self) -> bool:
        """Every row is a single-token decode (what a decode CUDA graph can run)."""
        return not self.prefills


def lay_out(batch: ScheduledBatch, block_size: int) -> StepLayout:
    bs = block_size
    order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
    step = StepLayout()
    draft_rows: list[int] = []
    for i in order:
        seq, start, n = batch.seqs[i], batch.starts[i], batch.num_new_tokens[i]
        end = start + n
        q_start = len(step.ids)
        step.ids += seq.tokens_slice(start, end) + seq.draft_token_ids
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table)
        step.positions.append(pos)
        step.slots.append(table[pos // bs] * bs + pos % bs)
        num_blocks = -(-end // bs)
        if n == 1:
            step.decode_tables.append(table[:num_blocks])
            step.decode_lens.append(end)
        else:
            step.prefills.append((q_start, n, end))
            step.prefill_tables.append(table[:num_blocks])
        if seq.draft_token_ids:  # every row: the model's choice after each draft
            draft_rows.extend(range(q_start, q_start + n))
            step.drafted.append(seq)
        elif end == seq.num_tokens:
            step.logit_rows.append(q_start + n - 1)
            step.sampled.append(seq)
    step.logit_rows += draft_rows
    return step
