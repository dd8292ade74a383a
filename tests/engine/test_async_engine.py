"""`AsyncEngine` owns the step thread: control calls (reset, dropping and saving sessions,
shutdown) made while steps run happen between steps, never inside one, and leave the pool
whole; the same calls made on the engine from another thread are refused."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_steps import engine_steps

from shoal import AsyncEngine, Engine, SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CALLS_PER_WAVE = 8  # control calls per wave of requests, each after one more engine step


@pytest.fixture
def engine(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> Engine:
    return Engine(
        model=str(tiny_model_dir("llama")),
        dtype="float64",
        block_size=4,
        num_blocks=96,  # tight: sessions spill and requests preempt while calls land
        batch_wait_s=0.0,
        cache_dir=str(tmp_path / "kv"),
    )


def pool_whole(engine: Engine) -> bool:
    """Every block's reference count is exactly the number of sessions and requests that
    hold it, and the free count matches."""
    held: dict[int, int] = {}
    tables = [s.block_ids for s in engine.sessions]
    tables += [q.block_table for q in engine.scheduler.running + engine.scheduler.waiting]
    for table in tables:
        for b in table:
            held[b] = held.get(b, 0) + 1
    blocks = engine.pool.blocks
    return all(b.ref_cnt == held.get(b.block_id, 0) for b in blocks) and (
        engine.pool.num_free == sum(b.ref_cnt == 0 for b in blocks)
    )


async def run_one(aeng: AsyncEngine, prompt: list[int], sid: str | None) -> str | None:
    last: Any = None
    async for out in aeng.generate(prompt, PARAMS, session_id=sid):
        last = out
    return last.finish_reason if last is not None else None


async def test_control_calls_during_steps_never_corrupt_the_pool(engine: Engine) -> None:
    aeng = AsyncEngine(engine)
    rng = random.Random(0)
    sids = ["a", "b", "c", "d", None]
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))] for _ in range(60)]
    work: list[asyncio.Task[str | None]] = []
    with engine_steps(engine) as steps:
        steps.hold()
        for wave in range(3):  # the first wave meets a reset; the others run to their length
            work += [
                asyncio.create_task(run_one(aeng, p, sids[i % len(sids)]))
                for i, p in enumerate(prompts[20 * wave : 20 * wave + 20])
            ]
            arrived = 20 * (wave + 1)
            await asyncio.to_thread(steps.wait, lambda n=arrived: len(steps.arrived) >= n)
            for call in range(CALLS_PER_WAVE):  # each call lands after one more step
                await asyncio.to_thread(steps.step_once)
                op = rng.randrange(2)
                if wave == 0 and call == 3:
                    await aeng.reset()  # aborts whatever runs: those requests finish as "abort"
                elif op == 0:
                    await aeng.drop_session(rng.choice("abcd"))
                else:
                    await aeng.save_sessions()
                assert await aeng.call(pool_whole, engine)
            steps.release()
            await asyncio.gather(*work)
            steps.hold()
    reasons = [t.result() for t in work]
    assert set(reasons) == {"length", "abort"}
    await aeng.shutdown()
    assert pool_whole(engine)


async def test_engine_state_changes_from_another_thread_are_refused(engine: Engine) -> None:
    aeng = AsyncEngine(engine)
    errors: list[BaseException] = []

    def meddle() -> None:
        for fn in (lambda: engine.drop_session("a"), engine.reset, engine.save_sessions):
            try:
                fn()
            except RuntimeError as e:
                errors.append(e)

    thread = threading.Thread(target=meddle)
    thread.start()
    thread.join()
    assert len(errors) == 3 and "step thread" in str(errors[0])
    assert await aeng.drop_session("nobody") is False  # the same call, through the loop
    await aeng.shutdown()
    assert engine.drop_session("nobody") is False  # no step thread any more: direct is fine


async def test_shutdown_past_its_drain_timeout_aborts_on_the_step_thread(engine: Engine) -> None:
    aeng = AsyncEngine(engine)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> str | None:
        last: Any = None
        async for out in aeng.generate([5 + i, 6, 7, 8], long):
            last = out
        return last.finish_reason if last is not None else None

    with engine_steps(engine) as steps:
        steps.hold()
        work = [asyncio.create_task(one(i)) for i in range(6)]
        await asyncio.to_thread(steps.wait, lambda: len(steps.arrived) == 6)
        await asyncio.to_thread(steps.step_once)  # all six started, none can finish
        await aeng.shutdown(drain_timeout=0.05)
    assert await asyncio.gather(*work) == ["abort"] * 6
    assert not engine.has_unfinished_requests() and pool_whole(engine)
