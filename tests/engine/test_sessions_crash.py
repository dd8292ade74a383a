"""kill -9 in the middle of saving a session: what a restart then uses is whole.

A child process saves one version of a session, computes a second turn, and starts saving it
(its blocks, then its manifest) with `os.fsync` made to hang at the k-th call (the manifest's
temporary file, the folder after its rename); the parent kills it there with SIGKILL. A new
engine on the same folder must sweep the debris, restore either the old version or the new
one, never a mix, and give the same tokens as an engine with no cache at all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal import Engine, SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
P1 = [5, 6, 7, 8, 9, 10, 11]
MORE = [12, 13, 14]


CHILD = f"""
import os, sys, time
from pathlib import Path
from shoal import Engine, SamplingParams

model, cache, marker, hang_at = sys.argv[1:5]
engine = Engine(model=model, dtype="float64", block_size=4, num_blocks=64, cache_dir=cache)
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

def turn(prompt):
    engine.add_request(prompt, params, session_id="s")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.token_ids
    return tokens

p1 = {P1!r}
o1 = turn(p1)
engine.save_sessions()  # version 1 is whole on disk
turn(p1 + o1 + {MORE!r})  # version 2 is in memory only
real_fsync, calls = os.fsync, [0]

def hanging_fsync(fd):
    calls[0] += 1
    if calls[0] == int(hang_at):
        Path(marker).write_text("saving")
        time.sleep(600)
    real_fsync(fd)

os.fsync = hanging_fsync
engine.save_sessions()
"""


def turn(engine: Engine, prompt: list[int], session: str | None) -> tuple[list[int], int]:
    engine.add_request(prompt, PARAMS, session_id=session)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = (out.token_ids, out.num_cached_tokens)
    return result


@pytest.mark.parametrize("hang_at", [1, 2])  # manifest temporary, committed
def test_kill_during_save_never_leaves_a_used_partial_file(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, hang_at: int
) -> None:
    model = tiny_model_dir("llama")
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(model), str(cache), str(marker), str(hang_at)],
        cwd=repo,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the child exited before the save"
            assert time.monotonic() < deadline, "the child never reached the save"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()

    def engine(**kw: Any) -> Engine:
        return Engine(model=str(model), dtype="float64", block_size=4, num_blocks=64, **kw)

    reference = engine(enable_prefix_caching=False)
    o1, _ = turn(reference, P1, None)
    p2 = P1 + o1 + MORE
    o2, _ = turn(reference, p2, None)
    p3 = p2 + o2 + [15, 16]
    o3, _ = turn(reference, p3, None)

    restarted = engine(cache_dir=str(cache))
    (folder,) = list(cache.iterdir())
    assert not list(folder.rglob("*.tmp"))  # temporaries swept
    assert len(list((folder / "sessions").iterdir())) == 1
    (info,) = restarted.list_sessions()
    version = p2 + o2 if hang_at == 2 else P1 + o1  # the manifest's rename is the commit point
    assert info.num_tokens == len(version) - 1
    tokens, cached = turn(restarted, p3, "s")
    assert tokens == o3
    # At least the saved version; blocks of the newer turn that reached the disk serve too
    # (they are named by their contents, so they cannot be another version's).
    assert cached >= info.num_tokens
    assert restarted.stats().disk_reads == 1
