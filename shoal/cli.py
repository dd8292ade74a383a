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
from shoal.config import BACKENDS, EngineConfig, GiB, MiB
from shoal.errors import ShoalError
from shoal.quota.cli import add_parser as add_quota_parser
from shoal.sampling_params import SamplingParams
from shoal.server.keys import add_parser as add_keys_parser

if TYPE_CHECKING:
    from shoal.server.state import ServerConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled)")
    p.add_argument(
        "--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16", "float64")
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
    g = p.add_argument_group("structured outputs (grammar compiles)")
    g.add_argument(
        "--grammar-workers", type=int, default=d.grammar_workers, help="compile worker processes"
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d.grammar_compile_timeout_s,
        help="seconds one compile may take before its constraint is refused",
    )
    g.add_argument(
        "--grammar-compile-mib",
        type=int,
        default=d.grammar_compile_bytes // MiB,
        help="memory one compile may take before its constraint is refused",
    )
    g.add_argument(
        "--grammar-wait-timeout",
        type=float,
        default=d.grammar_wait_s,
        help="seconds a request waits for its grammar, queue included (then a 429)",
    )
    g.add_argument(
        "--grammar-cache-mib",
        type=int,
        default=d.grammar_cache_bytes // MiB,
        help="compiled grammars kept, least recently used dropped first",
    )
    p.add_argument(
        "--host-kv-gib",
        type=float,
        default=d.host_kv_bytes / GiB,
        help="host memory for KV blocks the pool evicts (the store's second tier)",
    )
    p.add_argument(
        "--disk-kv-gib",
        type=float,
        default=d.disk_kv_bytes / GiB,
        help="disk under the cache dir for KV blocks host memory evicts (third tier)",
    )


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
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gib * GiB),
        enable_prefix_caching=not args.no_prefix_caching,
        num_speculative_tokens=args.num_speculative_tokens,
        cache_dir=args.cache_dir,
        grammar_workers=args.grammar_workers,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        grammar_compile_bytes=args.grammar_compile_mib * MiB,
        grammar_wait_s=args.grammar_wait_timeout,
        grammar_cache_bytes=args.grammar_cache_mib * MiB,
        host_kv_bytes=int(args.host_kv_gib * GiB),
        disk_kv_bytes=int(args.disk_kv_gib * GiB),
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
    from shoal.server.schema_check import SchemaLimits
    from shoal.server.state import ServerConfig

    if args.quota:  # a bad limits file is a message, before the model loads
        from shoal.server.quota import read_config

        try:
            read_config(args.quota)
        except (OSError, ShoalError) as e:
            print(f"shoal serve: --quota: {e}", file=sys.stderr)
            return None
    if args.keys:  # a keys file that cannot be used: one line, before the model loads
        from shoal.server.keys import read_keys

        try:
            read_keys(args.keys)
        except ShoalError as e:
            print(f"shoal serve: {e}", file=sys.stderr)
            return None
    if args.batch_lease_s <= 0:
        print("shoal serve: --batch-lease-s must be positive", file=sys.stderr)
        return None
    if args.responses_keep < 1 or args.responses_max_age_days <= 0:
        print("shoal serve: --responses-keep and --responses-max-age-days must be positive",
              file=sys.stderr)  # fmt: skip
        return None
    return ServerConfig(
        engine=engine_config(
            args, max_waiting=args.max_waiting, session_tier_dir=args.session_tier
        ),
        data_dir=Path(args.data_dir),
        api_key=args.api_key,
        keys_file=Path(args.keys) if args.keys else None,
        metrics_key=args.metrics_key,
        batch_concurrency=args.batch_concurrency,
        quota_config=Path(args.quota) if args.quota else None,
        store=args.store,
        batch_lease_s=args.batch_lease_s,
        schema_limits=SchemaLimits(
            properties=args.max_schema_properties,
            depth=args.max_schema_depth,
            enum_values=args.max_schema_enum_values,
            chars=args.max_schema_chars,
            large_enum_chars=args.max_schema_large_enum_chars,
        ),
        responses_keep=args.responses_keep,
        responses_max_age_s=args.responses_max_age_days * 86400.0,
        keep_billing_header=args.keep_billing_header,
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
    serve.add_argument(
        "--keys",
        default=None,
        help="a TOML file of hashed API keys, each a tenant's (docs/tenancy.md); SIGHUP reloads it",
    )
    serve.add_argument("--metrics-key", default=None, help="/metrics asks for this key")
    serve.add_argument("--max-waiting", type=int, default=1024, help="queued requests before 429")
    serve.add_argument(
        "--batch-concurrency", type=int, default=0, help="batch requests in flight (0: 2 x seqs)"
    )
    serve.add_argument(
        "--quota", default=None, help="limits file with a [serve] rpm/tpm budget per tenant or key"
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
        "--responses-keep",
        type=int,
        default=100_000,
        help="stored /v1/responses objects kept at most (the oldest go first)",
    )
    serve.add_argument(
        "--responses-max-age-days",
        type=float,
        default=30.0,
        help="stored /v1/responses objects are dropped after this many days",
    )
    serve.add_argument(
        "--session-tier",
        default=None,
        help="a folder each finished turn's session KV is written behind to; servers sharing "
        "it restore each other's sessions (and a restart, the turns a kill -9 cut off)",
    )
    from shoal.server.schema_check import SchemaLimits

    limits = serve.add_argument_group(
        "JSON schema limits (OpenAI's for strict structured outputs; past them, a 400)"
    )
    for name, what in [
        ("properties", "object properties in all"),
        ("depth", "levels of nesting"),
        ("enum_values", "enum values in all"),
        ("chars", "characters of property and definition names, enum and const values"),
        ("large_enum_chars", "characters of one string enum of more than 250 values"),
    ]:
        flag = "--max-schema-" + name.replace("_", "-")
        limits.add_argument(flag, type=int, default=getattr(SchemaLimits(), name), help=what)
    serve.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's per-request x-anthropic-billing-header system line (by default "
        "it is removed before tokenising, since it defeats every prefix cache)",
    )
    _engine_args(serve)
    _backend_arg(serve)


def _sessions(args: argparse.Namespace) -> int:
    """Print what a running server's KV store holds, tier by tier (`GET /v1/kv`)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.get(f"{args.url.rstrip('/')}/v1/kv", headers=headers, timeout=30)
    if r.status_code != 200:
        print(f"shoal sessions: {r.status_code} {r.text}", file=sys.stderr)
        return 1
    body = r.json()
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    for name, t in body["tiers"].items():
        facts = ", ".join(f"{k} {v}" for k, v in t.items())
        print(f"{name:7} {facts}")
    for s in body["sessions"]:
        where = "pool" if s["in_memory"] else "store"
        print(f"session {s['session_id']}: {s['state']}, {s['num_tokens']} tokens, in the {where}")
    for p in body["pins"]:
        print(f"pin     {p['name']}: {p['blocks']} blocks, expires {p['expires']}")
    return 0


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

    ses = sub.add_parser("sessions", help="list what a server's KV store holds, tier by tier")
    ses.add_argument("--url", default="http://127.0.0.1:8000")
    ses.add_argument("--api-key", default=None)
    ses.add_argument("--json", action="store_true")
    ses.set_defaults(func=_sessions)

    bf = sub.add_parser("batchify", help="run a script; its SDK calls become Batch API jobs")
    batchify_arguments(bf)
    bf.set_defaults(func=_batchify)

    add_quota_parser(sub)
    add_keys_parser(sub)
    add_cluster_parser(sub, _server_arguments, _server_config)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
