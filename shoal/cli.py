"""The `shoal` command: generate, bench, serve. Thin: parsing here, work elsewhere."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shoal.sampling_params import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV block pool size")


def _generate(args: argparse.Namespace) -> int:
    from shoal.llm import LLM

    prompts = list(args.prompt)
    if args.file:
        prompts += [ln for ln in Path(args.file).read_text().splitlines() if ln.strip()]
    if not prompts:
        print("give a prompt or --file", file=sys.stderr)
        return 2
    llm = LLM(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
    )
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


def _serve(args: argparse.Namespace) -> int:
    from shoal.server.app import serve

    serve(args)
    return 0


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
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="run workload W1 (64 requests) and print throughput")
    bench.add_argument("--num-requests", type=int, default=64)
    _engine_args(bench)
    bench.set_defaults(func=_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", default="./shoal-data")
    serve.add_argument("--api-key", default=None)
    _engine_args(serve)
    serve.set_defaults(func=_serve)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
