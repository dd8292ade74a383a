"""Decode CUDA graphs: which batch sizes are captured, which bucket a step pads to, and the
input rows a step writes (plain NumPy, checked on any machine); on CUDA, that a replayed graph
computes the eager step's logits and that its padding rows touch no block a request holds."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from shoal import SamplingParams
from shoal.engine.cuda_graphs import ID, POSITION, SEQ_LEN, SLOT, TABLE, DecodeRows, graph_sizes
from shoal.engine.scheduler import ScheduledBatch
from shoal.engine.sequence import Sequence
from shoal.engine.step_layout import StepLayout, lay_out


def test_default_sizes_pad_a_step_by_at_most_seven_rows():
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(3) == [1, 2, 3]
    sizes = graph_sizes(256)
    assert all(b - a <= 8 for a, b in itertools.pairwise(sizes))


def test_given_sizes_are_sorted_deduplicated_and_capped():
    assert graph_sizes(64, [32, 8, 8, 1, 100]) == [1, 8, 32]


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    rows = DecodeRows(graph_sizes(64), width=8, pad_block=99, block_size=4)
    assert [rows.bucket(n) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert rows.bucket(65) is None
    assert rows.shape == (64, TABLE + 8)


def _seq(rid: str, prompt: list[int], output: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=8))
    seq.output_token_ids = list(output)
    seq.block_table = blocks
    return seq


def _decodes(lengths: list[int], block_size: int = 4) -> StepLayout:
    """A step of one decode per length (the last of that many tokens), blocks 10, 11, ... in
    order per sequence."""
    batch = ScheduledBatch(step_id=0)
    next_block = 10
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        seq = _seq(f"r{i}", list(range(100, 100 + n - 1)), [7 + i], blocks)
        batch.seqs.append(seq)
        batch.starts.append(n - 1)
        batch.num_new_tokens.append(1)
    return lay_out(batch, block_size)


def test_the_layout_puts_decodes_first_and_maps_slots_through_block_tables():
    decode = _seq("d", [5, 6, 7, 8, 9], [3], [4, 2])  # its 6th token, position 5
    prefill = _seq("p", list(range(20, 30)), [], [9, 1, 6])  # tokens 4-9 after 4 cached
    batch = ScheduledBatch(0, [prefill, decode], [4, 5], [6, 1])
    step = lay_out(batch, block_size=4)
    assert step.ids == [3, 24, 25, 26, 27, 28, 29]
    assert step.decode_lens == [6] and step.decode_tables[0].tolist() == [4, 2]
    assert np.concatenate(step.slots).tolist() == [2 * 4 + 1, 4, 5, 6, 7, 6 * 4, 6 * 4 + 1]
    assert step.prefills == [(1, 6, 10)] and step.prefill_tables[0].tolist() == [9, 1, 6]
    assert step.logit_rows == [0, 6] and step.sampled == [decode, prefill]
    assert not step.decodes_only
    assert _decodes([3, 9]).decodes_only


def test_a_step_fills_its_rows_and_pads_the_rest_onto_the_pad_block():
    rows = DecodeRows([1, 2, 4, 8], width=4, pad_block=50, block_size=4)
    buf = np.full(rows.shape, -1, dtype=np.int64)
    rows.fill(buf[:8], _decodes([3, 14, 9, 9, 9, 9, 9]))  # stale rows from a longer step
    step = _decodes([3, 9, 14])
    assert rows.bucket(step.num_decodes) == 4
    rows.fill(buf[:4], step)
    assert buf[:3, ID].tolist() == [7, 8, 9]
    assert buf[:3, POSITION].tolist() == [2, 8, 13]
    assert buf[:3, SEQ_LEN].tolist() == [3, 9, 14]
    # Blocks 10 | 11 12 13 | 14 15 16 17: positions 2, 8 and 13 in blocks 10, 13 and 17.
    assert buf[:3, SLOT].tolist() == [10 * 4 + 2, 13 * 4 + 0, 17 * 4 + 1]
    assert buf[:3, TABLE:].tolist() == [[10, 50, 50, 50], [11, 12, 13, 50], [14, 15, 16, 17]]
    # The padding row decodes token 0 at position 0 into the pad block's first slot only.
    assert buf[3].tolist() == [0, 0, 50 * 4, 1, 50, 50, 50, 50]


def test_only_small_enough_decode_steps_fit_a_graph():
    rows = DecodeRows([1, 2, 4], width=3, pad_block=50, block_size=4)
    assert rows.fits(_decodes([3, 12]))
    assert not rows.fits(_decodes([3, 12, 5, 5, 5]))  # five rows, four at most
    assert not rows.fits(_decodes([13]))  # four blocks, three at most
    prefill = _seq("p", list(range(20, 30)), [], [9, 1, 6])
    assert not rows.fits(lay_out(ScheduledBatch(0, [prefill], [0], [10]), 4))


def test_enforce_eager_and_sizes_are_engine_options():
    from shoal.config import EngineConfig
    from shoal.errors import InvalidRequestError

    assert EngineConfig(cuda_graph_sizes=(1, 64)).cuda_graph_sizes == (1, 64)
    with pytest.raises(InvalidRequestError, match="cuda_graph_sizes"):
        EngineConfig(max_num_seqs=8, cuda_graph_sizes=(16,))


# -- on CUDA -------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_replayed_graph_computes_the_eager_steps_logits(dtype, tiny_model_dir):
    from shoal.config import EngineConfig
    from shoal.engine.llm_engine import Engine

    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir("qwen3")),
            dtype=dtype,
            device="cuda",
            block_size=4,
            num_blocks=64,
            cuda_graph_sizes=(1, 2, 4, 8),
        )
    )
    runner = engine.runner
    graphs = runner.graphs
    assert graphs is not None and sorted(graphs._graphs) == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches():  # stand-in KV for every block, the pad block included
        k.copy_(torch.randn(k.shape, generator=gen).to(k))
        v.copy_(torch.randn(v.shape, generator=gen).to(v))
    rng = random.Random(0)
    step = _decodes([rng.randint(1, 40) for _ in range(5)])  # blocks 10..~60, a bucket of 8
    assert graphs.fits(step)
    before = [k[:64].clone() for k, _ in runner.kv_caches()]
    with torch.inference_mode():
        got = graphs.run(step)[:5].float()
        ids, positions, meta = runner._eager_inputs(step)
        want = runner.model.compute_logits(runner.model(ids, positions, meta)).float()
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # Only the real rows' slots changed among the pool's blocks (the eager step wrote the
    # same keys there); the padding rows wrote to block 64.
    slots = set(np.concatenate(step.slots).tolist())
    for old, (k, _) in zip(before, runner.kv_caches(), strict=True):
        changed = (old != k[:64]).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) <= slots
