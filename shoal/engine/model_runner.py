"""Runs one scheduled batch through the model: inputs, attention metadata, logits, samples."""

from __future__ import annotations

import numpy as np
import torch

from shoal.engine.cuda_graphs import DecodeGraphs, DecodeRows
from shoal.engine.host_memory import keep_freed_memory, return_freed_memory
from shoal.engine.output_processor import Sampled
from shoal.engine.sampler import sample, verify_drafts
from shoal.engine.scheduler import ScheduledBatch
from shoal.engine.sequence import Sequence
from shoal.engine.step_layout import StepLayout, lay_out
from shoal.layers import cpu_kernels
from shoal.layers.attention import AttentionMetadata, PrefillChunk
from shoal.layers.linear import native_bf16_products
from shoal.layers.quantized_linear import weight_bytes
from shoal.models.llama import LlamaForCausalLM


class ModelRunner:
    """Owns the model and its KV caches. With `graph_sizes` on CUDA, decode steps of up to the
    largest size replay CUDA graphs captured here, at start-up; their padding rows write to
    one block past the pool's (`num_blocks`), which no request ever holds."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: str,
        max_model_len: int | None = None,
        graph_sizes: list[int] | None = None,
    ) -> None:
        self.model = model.to(device).eval()
        self.block_size = block_size
        self.device = torch.device(device)
        if self.device.type == "cpu":
            return_freed_memory()  # what an engine closed before this one left
            keep_freed_memory()
        cfg = model.config
        dtype = model.dtype
        if self.device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16_products():
            kernels = cpu_kernels.native()
            if kernels is not None and kernels.has_gemm(dtype):
                model.use_float32_activations()
        if model.quantized and dtype in (torch.bfloat16, torch.float16):
            model.use_float32_activations()  # the integer products take float32 rows
        graphs = bool(graph_sizes) and self.device.type == "cuda"
        pad_blocks = 1 if graphs else 0
        shape = (num_blocks + pad_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        for attn in model.attention_layers:
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.device.type == "cpu":
            model.use_fused_decode()
        self.graphs: DecodeGraphs | None = None
        if graphs and graph_sizes:
            max_len = max_model_len or model.rotary.cos.shape[0]
            layout = DecodeRows(graph_sizes, -(-max_len // block_size), num_blocks, block_size)
            self.graphs = DecodeGraphs(model, layout, self.device)

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

    def _eager_inputs(
        self, step: StepLayout
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and attention metadata of the step, as tensors."""
        prefills = [
            PrefillChunk(q_start, q_len, ctx, self._tensor(table))
            for (q_start, q_len, ctx), table in zip(step.prefills, step.prefill_tables, strict=True)
        ]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(step.slots)),
            num_decodes=step.num_decodes,
            decode_block_tables=self._padded(step.decode_tables),
            decode_lens=self._tensor(step.decode_lens) if step.decode_lens else None,
            prefills=prefills,
            prefill_spans=self._tensor(np.array(step.prefills).reshape(-1, 3))
            if prefills
            else None,
            prefill_tables=self._padded(step.prefill_tables),
        )
        return self._tensor(step.ids), self._tensor(np.concatenate(step.positions)), meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], Sampled]:
        """Run the batch; return the sequences that reached their end and a token for each
        (after the drafts the model agreed with, for those that carried drafts). A step of
        decodes only replays a captured CUDA graph where one fits it."""
        step = lay_out(batch, self.block_size)
        if self.graphs is not None and self.graphs.fits(step):
            logits = self.graphs.run(step)
            if not step.logit_rows:
                return [], Sampled([], None, None)
            if step.logit_rows != list(range(len(step.logit_rows))):
                logits = logits[self._tensor(step.logit_rows)]
        else:
            input_ids, positions, meta = self._eager_inputs(step)
            hidden = self.model(input_ids, positions, meta)
            if not step.logit_rows:
                return [], Sampled([], None, None)
            logits = self.model.compute_logits(hidden[self._tensor(step.logit_rows)])
        seqs, drafted = step.sampled, step.drafted
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
