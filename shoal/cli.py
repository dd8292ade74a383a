"""The `shoal` command: generate, bench, serve, cluster, batchify, quota. Thin: parsing here,
work elsewhere."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.batchify.cli import add_arguments as batchify_arguments
from shoal.cluster.cli import add_parser as add_cluster_parser
from shoal.cluster.cli import add_replica_arguments
from shoal.config import BACKENDS, EngineConfig, GiB
from shoal.errors import ShoalError
from shoal.quota.cli import add_parser as add_quota_parser
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.server.state import ServerConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled)")
    p.add_argument(
        "--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16", "float64")
    )
    p.add_argument(
        "--quantization",
        default=d.quantization,
        choices=("gguf", "int8"),
        help="keep weights quantized: a GGUF's Q4_0/Q4_1/Q8_0 blocks, or int8 (Q8_0) at load",
    )
    p.add_argument(
        "--quantized-activations",
        default=d.quantized_activations,
        choices=("int16", "int8"),
        help="precision of quantized products' activations (int8: llama.cpp's, faster, ~1%% off)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running requests")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="per step"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument(
        "--kv-cache-gib", type=float, default=d.kv_cache_bytes / GiB, help="KV block pool size"
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help="draft tokens a step by prompt lookup, for greedy requests (0: off)",
    )
    p.add_argument("--cache-dir", default=None, help="where session KV persists across restarts")


def _backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        default=EngineConfig().backend,
        choices=BACKENDS,
        help="engine: torch, or mlx (pip install 'shoal[mlx]'; .gguf models)",
    )


def engine_config(args: argparse.Namespace, **extra: object) -> EngineConfig:
    """The `EngineConfig` the engine flags describe: every flag reaches the engine."""
    return EngineConfig(
        model=args.model,
        backend=args.backend,
        dtype=args.dtype,
        quantization=args.quantization,
        quantized_activations=args.quantized_activations,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gib * GiB),
        enable_prefix_caching=not args.no_prefix_caching,
        num_speculative_tokens=args.num_speculative_tokens,
        cache_dir=args.cache_dir,
        **extra,  # type: ignore[arg-type]
    )


def _generate(args: argparse.Namespace) -> int:
    from shoal.llm import LLM

    prompts = list(args.prompt)
    if args.file:
        prompts += [ln for ln in Path(args.file).read_text().splitlines() if ln.strip()]
    if not prompts:
        print("give a prompt or --file", file=sys.stderr)
        return 2
    llm = LLM(**dataclasses.asdict(engine_config(args)))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    chat = not args.raw and getattr(llm.tokenizer, "chat_template", None)
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(
                json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason})
            )
        else:
            print(out.text.strip())
    return 0


def _bench(args: argparse.Namespace) -> int:
    from shoal.bench import run_w1

    run_w1(model=args.model, dtype=args.dtype, num_requests=args.num_requests)
    return 0


def _server_config(args: argparse.Namespace) -> ServerConfig | None:
    """The `ServerConfig` the server flags describe; None (after a message) if they are bad."""
    from shoal.server.state import ServerConfig

    if args.quota:  # a bad limits file is a message, before the model loads
        from shoal.server.quota import read_config

        try:
            read_config(args.quota)
        except (OSError, ShoalError) as e:
            print(f"shoal serve: --quota: {e}", file=sys.stderr)
            return None
    if args.batch_lease_s <= 0:
        print("shoal serve: --batch-lease-s must be positive", file=sys.stderr)
        return None
    return ServerConfig(
        engine=engine_config(
            args, max_waiting=args.max_waiting, session_tier_dir=args.session_tier
        ),
        data_dir=Path(args.data_dir),
        api_key=args.api_key,
        batch_concurrency=args.batch_concurrency,
        quota_config=Path(args.quota) if args.quota else None,
        store=args.store,
        batch_lease_s=args.batch_lease_s,
    )


def _serve(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = _server_config(args)
    if config is None:
        return 2
    if args.replicas:
        from shoal.cluster.cli import serve_replicas

        return serve_replicas(args, config)
    from shoal.server.app import run_server

    run_server(config, args.host, args.port)
    return 0


def _server_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", default="./shoal-data", help="files, batches, sessions")
    serve.add_argument("--api-key", default=None, help="require this Bearer token")
    serve.add_argument("--max-waiting", type=int, default=1024, help="queued requests before 429")
    serve.add_argument(
        "--batch-concurrency", type=int, default=0, help="batch requests in flight (0: 2 x seqs)"
    )
    serve.add_argument(
        "--quota", default=None, help="limits file with a [serve] rpm/tpm budget per API key"
    )
    serve.add_argument(
        "--store",
        default=None,
        help="files and batches: a path, sqlite:///path.db or postgresql://user@host/db, "
        "shared by every server given the same one (default: SQLite in --data-dir)",
    )
    serve.add_argument(
        "--batch-lease-s",
        type=float,
        default=10.0,
        help="a dead server's batch lines go to the others after this many seconds",
    )
    serve.add_argument(
        "--session-tier",
        default=None,
        help="a folder each finished turn's session KV is written behind to; servers sharing "
        "it restore each other's sessions (and a restart, the turns a kill -9 cut off)",
    )
    _engine_args(serve)
    _backend_arg(serve)


def _batchify(args: argparse.Namespace) -> int:
    from shoal.batchify.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--file", help="one prompt per line")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _engine_args(gen)
    _backend_arg(gen)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="run workload W1 (64 requests) and print throughput")
    bench.add_argument("--num-requests", type=int, default=64)
    _engine_args(bench)
    bench.set_defaults(func=_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _server_arguments(serve)
    add_replica_arguments(serve)
    serve.set_defaults(func=_serve)

    bf = sub.add_parser("batchify", help="run a script; its SDK calls become Batch API jobs")
    batchify_arguments(bf)
    bf.set_defaults(func=_batchify)

    add_quota_parser(sub)
    add_cluster_parser(sub, _server_arguments, _server_config)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
