"""Runs one scheduled batch through the model: inputs, attention metadata, logits, samples."""

from __future__ import annotations

import numpy as np
import torch

from shoal.engine.host_memory import keep_freed_memory
from shoal.engine.output_processor import Sampled
from shoal.engine.sampler import sample, verify_drafts
from shoal.engine.scheduler import ScheduledBatch
from shoal.engine.sequence import Sequence
from shoal.layers import cpu_kernels
from shoal.layers.attention import AttentionMetadata, PrefillChunk
from shoal.layers.linear import native_bf16_products
from shoal.layers.quantized_linear import weight_bytes
from shoal.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: str
    ) -> None:
        self.model = model.to(device).eval()
        self.block_size = block_size
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()
        cfg = model.config
        dtype = model.dtype
        if self.device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16_products():
            kernels = cpu_kernels.native()
            if kernels is not None and kernels.has_gemm(dtype):
                model.use_float32_activations()
        if model.quantized and dtype in (torch.bfloat16, torch.float16):
            model.use_float32_activations()  # the integer products take float32 rows
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        for attn in model.attention_layers:
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.device.type == "cpu":
            model.use_fused_decode()

    def _tensor(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=self.device)

    def _padded(self, tables: list[np.ndarray]) -> torch.Tensor | None:
        """Block tables of different lengths as one zero-padded `[rows, max_len]` tensor."""
        if not tables:
            return None
        padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for r, t in enumerate(tables):
            padded[r, : len(t)] = t
        return self._tensor(padded)

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence], list[Sequence]
    ]:
        bs = self.block_size
        # Single-token queries (decodes) first: they share one padded, batched attention call.
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        decode_tables: list[np.ndarray] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        prefill_tables: list[np.ndarray] = []
        logit_rows: list[int] = []
        sampled_seqs: list[Sequence] = []
        draft_rows: list[int] = []
        draft_seqs: list[Sequence] = []
        for i in order:
            seq, start, n = batch.seqs[i], batch.starts[i], batch.num_new_tokens[i]
            end = start + n
            q_start = len(ids)
            ids += seq.tokens_slice(start, end) + seq.draft_token_ids
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            num_blocks = -(-end // bs)
            if n == 1:
                decode_tables.append(table[:num_blocks])
                decode_lens.append(end)
            else:
                prefills.append(PrefillChunk(q_start, n, end, self._tensor(table[:num_blocks])))
                prefill_tables.append(table[:num_blocks])
            if seq.draft_token_ids:  # every row: the model's choice after each draft
                draft_rows.extend(range(q_start, q_start + n))
                draft_seqs.append(seq)
            elif end == seq.num_tokens:
                logit_rows.append(q_start + n - 1)
                sampled_seqs.append(seq)

        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)),
            num_decodes=len(decode_tables),
            decode_block_tables=self._padded(decode_tables),
            decode_lens=self._tensor(decode_lens) if decode_lens else None,
            prefills=prefills,
            prefill_spans=self._tensor(
                np.array([(c.q_start, c.q_len, c.context_len) for c in prefills]).reshape(-1, 3)
            )
            if prefills
            else None,
            prefill_tables=self._padded(prefill_tables),
        )
        return (
            self._tensor(ids),
            self._tensor(np.concatenate(positions)),
            meta,
            logit_rows + draft_rows,
            sampled_seqs,
            draft_seqs,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], Sampled]:
        """Run the batch; return the sequences that reached their end and a token for each
        (after the drafts the model agreed with, for those that carried drafts)."""
        input_ids, positions, meta, rows, seqs, drafted = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if not rows:
            return [], Sampled([], None, None)
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        sampled = sample(logits[: len(seqs)], seqs)
        if drafted:
            verify_drafts(logits[len(seqs) :], drafted, sampled)
        return seqs + drafted, sampled

    def weight_bytes(self) -> dict[str, int]:
        """Resident bytes of the model's weights by storage format (`/metrics`)."""
        return weight_bytes(self.model)

    # -- KV block moves for sessions (copy on write, the disk tier) ------------------------
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's `(k_cache, v_cache)`, `[num_blocks, block_size, kv_heads, head_dim]`."""
        return [(attn.k_cache, attn.v_cache) for attn in self.model.attention_layers]

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's KV in every layer (a session's partial last block, on write)."""
        for k, v in self.kv_caches():
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])
