"""The engine's flags (`generate`, `bench`, `serve`, `cluster deploy`) and the `EngineConfig`
they describe: every flag reaches the engine."""

from __future__ import annotations

import argparse

from shoal.config import BACKENDS, EngineConfig, GiB, MiB


def engine_arguments(p: argparse.ArgumentParser, backend: bool = True) -> None:
    d = EngineConfig()
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="an HF folder (config.json, safetensors, tokenizer) or a .gguf file; "
        "default: the bundled SmolLM2-135M-Instruct",
    )
    if backend:
        model.add_argument(
            "--backend",
            default=d.backend,
            choices=BACKENDS,
            help="engine: torch, or mlx (pip install 'shoal[mlx]'; .gguf models)",
        )
    model.add_argument(
        "--dtype",
        default=d.dtype,
        choices=("float32", "bfloat16", "float16", "float64"),
        help="weights and KV cache (on a CPU, bfloat16 keeps float32 activations)",
    )
    model.add_argument(
        "--quantization",
        default=d.quantization,
        choices=("gguf", "int8"),
        help="keep weights quantized: a GGUF's Q4_0/Q4_1/Q8_0 blocks, or int8 (Q8_0) at load",
    )
    model.add_argument(
        "--quantized-activations",
        default=d.quantized_activations,
        choices=("int16", "int8"),
        help="precision of quantized products' activations (int8: llama.cpp's, faster, ~1%% off)",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        default=None,
        help="longest prompt + answer; default: the model's",
    )

    dev = p.add_argument_group("device")
    dev.add_argument(
        "--device",
        default=d.device,
        metavar="DEVICE",
        help="where the model runs: cpu, cuda or cuda:N",
    )
    dev.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs",
    )
    dev.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        metavar="N",
        default=None,
        help="decode batch sizes captured as CUDA graphs at start-up; "
        "default: 1, 2, 4, then multiples of 8 up to --max-num-seqs",
    )

    batch = p.add_argument_group("batching")
    batch.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        default=d.max_num_seqs,
        help="requests in the running batch",
    )
    batch.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        default=d.max_num_batched_tokens,
        help="tokens computed per step (a longer prompt is prefilled in chunks)",
    )
    batch.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="N",
        default=d.num_speculative_tokens,
        help="draft tokens a step by prompt lookup, for greedy requests (0: off)",
    )

    kv = p.add_argument_group("KV cache and its tiers (pool -> host memory -> disk)")
    kv.add_argument(
        "--block-size", type=int, metavar="N", default=d.block_size, help="tokens per KV block"
    )
    kv.add_argument(
        "--kv-cache-gib",
        type=float,
        metavar="GIB",
        default=d.kv_cache_bytes / GiB,
        help="the KV block pool",
    )
    kv.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full (no reuse of earlier requests' KV)",
    )
    kv.add_argument(
        "--host-kv-gib",
        type=float,
        metavar="GIB",
        default=d.host_kv_bytes / GiB,
        help="host memory for KV blocks the pool evicts (the second tier)",
    )
    kv.add_argument(
        "--disk-kv-gib",
        type=float,
        metavar="GIB",
        default=d.disk_kv_bytes / GiB,
        help="disk under --cache-dir for KV blocks host memory evicts (the third tier)",
    )
    kv.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="where sessions and the disk tier persist across restarts (serve: "
        "DATA_DIR/sessions; otherwise a temporary folder, gone at exit)",
    )

    g = p.add_argument_group("structured outputs (grammar compiles)")
    g.add_argument(
        "--grammar-workers",
        type=int,
        metavar="N",
        default=d.grammar_workers,
        help="compile worker processes",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        metavar="S",
        default=d.grammar_compile_timeout_s,
        help="seconds one compile may take before its constraint is refused",
    )
    g.add_argument(
        "--grammar-compile-mib",
        type=int,
        metavar="MIB",
        default=d.grammar_compile_bytes // MiB,
        help="memory one compile may take before its constraint is refused",
    )
    g.add_argument(
        "--grammar-wait-timeout",
        type=float,
        metavar="S",
        default=d.grammar_wait_s,
        help="seconds a request waits for its grammar, queue included (then a 429)",
    )
    g.add_argument(
        "--grammar-cache-mib",
        type=int,
        metavar="MIB",
        default=d.grammar_cache_bytes // MiB,
        help="compiled grammars kept, least recently used dropped first",
    )


def engine_config(args: argparse.Namespace, **extra: object) -> EngineConfig:
    """The `EngineConfig` the engine flags describe."""
    return EngineConfig(
        model=args.model,
        backend=getattr(args, "backend", EngineConfig().backend),
        dtype=args.dtype,
        quantization=args.quantization,
        quantized_activations=args.quantized_activations,
        device=args.device,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
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
