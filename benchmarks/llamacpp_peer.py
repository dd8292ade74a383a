"""llama.cpp's `llama-server` as a W1 peer: started for its turn, fed the same token ids.

Built by `benchmarks/setup_llamacpp.sh` (cached). The server gets 64 slots (one per request,
each with its own KV stream), `-t 2` threads for both decoding and prompt processing, no prompt
cache, and llama.cpp's own default KV cache type, F16 (an F32 cache, as shoal keeps in float32,
halved llama.cpp's throughput on a 2-core Zen 3: forcing it would handicap the peer). Each
request is a `/completion` call on the prompt's token ids, greedy, EOS ignored,
`cache_prompt: false`, so every prompt is computed in full.

`batched_bench` runs llama.cpp's engine without its server: `llama-batched-bench` decodes all
sequences together at W1's mean prompt length, with no HTTP or slot bookkeeping: the best this
build of llama.cpp does on the same work.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
from serve_process import free_port, stop

GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def setup(repo: Path) -> Path:
    """Run the set-up script (a no-op once built); returns the folder with bin and GGUFs."""
    out = subprocess.run(
        ["bash", str(repo / "benchmarks" / "setup_llamacpp.sh")],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


@dataclass(slots=True)
class PeerRun:
    rate: float  # output tokens per second
    elapsed: float
    outputs: list[list[int]]
    command: list[str]


def float_gguf(root: Path, dtype: str) -> Path:
    """The bundled model dequantized by `setup_llamacpp.sh` into `dtype`'s GGUF type."""
    return root / f"smollm2-135m-{GGUF_TYPES[dtype]}.gguf"


def run(
    root: Path, model: Path, prompts: list[list[int]], max_tokens: int, threads: int
) -> PeerRun:
    port = free_port()
    ctx_per_slot = max(len(p) for p in prompts) + max_tokens + 16
    slots = len(prompts)
    cmd = [
        str(root / "build" / "bin" / "llama-server"),
        *("-m", str(model)),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("-np", str(slots), "-c", str(slots * ctx_per_slot)),
        *("-t", str(threads), "-tb", str(threads)),
        *("--cache-ram", "0", "--no-webui"),
    ]
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=None) as client:  # a loaded machine is slow
        server, log = _start(client, cmd, root / "llama-server.log")

        def one(prompt: list[int]) -> list[int]:
            body = {
                "prompt": prompt,
                "n_predict": max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
            }
            r = client.post("/completion", json=body)
            r.raise_for_status()
            return list(r.json()["tokens"])

        try:
            one(prompts[0][:8])  # warm-up: first-call allocations
            start = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                outputs = list(pool.map(one, prompts))
            elapsed = time.perf_counter() - start
        finally:
            stop(server, timeout=30)
            log.close()
    return PeerRun(sum(map(len, outputs)) / elapsed, elapsed, outputs, cmd)


def _start(
    client: httpx.Client, cmd: list[str], log_path: Path
) -> tuple[subprocess.Popen[bytes], IO[str]]:
    """llama-server, once it answers `/health`, and its open log (once more `without_repack`
    if it dies while loading)."""
    while True:
        log = log_path.open("w")  # a pipe left unread would block the server
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(client, server, log_path)
            return server, log
        except RuntimeError:
            log.close()
            if not without_repack(cmd, server.returncode):
                server.kill()
                raise


def without_repack(cmd: list[str], returncode: int | None) -> bool:
    """Whether to run llama.cpp's `cmd` again, `--no-repack` appended to it here: its repacked
    (AMX) products crash in ggml_backend_amx_mul_mat on some AMX machines (llama.cpp #20824,
    open; seen on an Emerald Rapids VM and a Xeon with AMX-INT8), so a process killed by a
    signal gets one more run on the AVX-512 kernels over the file's own layout."""
    if returncode is None or returncode >= 0 or "--no-repack" in cmd:
        return False
    print(f"llama.cpp died of signal {-returncode}: again with --no-repack", file=sys.stderr)
    cmd.append("--no-repack")
    return True


def batched_bench(
    root: Path, model: Path, prompt_len: int, max_tokens: int, parallel: int, threads: int
) -> PeerRun:
    """`llama-batched-bench` with flash attention and one KV stream per sequence (the fastest
    of flash attention on/off x unified KV on/off on this CPU); no outputs to compare."""
    cmd = [
        str(root / "build" / "bin" / "llama-batched-bench"),
        *("-m", str(model)),
        *("-c", str(parallel * (prompt_len + max_tokens + 16))),
        *("-npp", str(prompt_len), "-ntg", str(max_tokens), "-npl", str(parallel)),
        *("-t", str(threads), "-tb", str(threads)),
        *("-fa", "on", "-no-kvu"),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    # The result row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("|")]
    elapsed = float(rows[-1][8])
    return PeerRun(parallel * max_tokens / elapsed, elapsed, [], cmd)


def _wait_ready(client: httpx.Client, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"llama-server exited ({server.returncode}): {tail}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("llama-server did not become ready in 120 s")
