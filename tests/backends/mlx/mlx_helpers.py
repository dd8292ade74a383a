"""Helpers for the MLX backend tests."""

from __future__ import annotations

from typing import Any

from shoal.backends.mlx import BlockPoolBatchEngine


def run(engine: BlockPoolBatchEngine, max_steps: int = 10_000) -> dict[int, Any]:
    """Step until idle; completions by uid."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return done
        for c in engine.step():
            done[c.uid] = c
    raise AssertionError("the engine did not go idle")
