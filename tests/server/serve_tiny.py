"""Run a server on 127.0.0.1 for subprocess tests (kill -9, SIGTERM): `shoal serve` plus the
settings tests need (a small KV pool, batch concurrency, a shared store and its lease, the
batch line gate, the grammar cache and compile timeout)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.config import EngineConfig
from shoal.server.app import run_server
from shoal.server.state import ServerConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--batch-concurrency", type=int, default=4)
    p.add_argument("--store", default=None)
    p.add_argument("--batch-lease-s", type=float, default=10.0)
    p.add_argument("--batch-gate", type=Path, default=None)
    p.add_argument("--grammar-cache-mib", type=int, default=256)
    p.add_argument("--grammar-compile-timeout", type=float, default=20.0)
    p.add_argument("--keys", type=Path, default=None)
    a = p.parse_args()
    engine = EngineConfig(
        model=a.model,
        num_blocks=a.num_blocks,
        max_num_seqs=a.max_num_seqs,
        max_waiting=1024,
        grammar_cache_bytes=a.grammar_cache_mib << 20,
        grammar_compile_timeout_s=a.grammar_compile_timeout,
    )
    config = ServerConfig(
        engine=engine,
        data_dir=Path(a.data_dir),
        batch_concurrency=a.batch_concurrency,
        store=a.store,
        batch_lease_s=a.batch_lease_s,
        batch_gate=a.batch_gate,
        keys_file=a.keys,
    )
    run_server(config, "127.0.0.1", a.port, log_level="warning")


if __name__ == "__main__":
    main()
