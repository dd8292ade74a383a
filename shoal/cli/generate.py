"""`shoal generate` (prompts in, answers out, no server) and `shoal bench` (workload W1)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from shoal.cli.engine_args import engine_arguments, engine_config
from shoal.cli.formatting import examples
from shoal.sampling_params import SamplingParams


def add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser(
        "generate",
        help="answer prompts with a model, in one batch, without a server",
        description="Answer prompts in one batch; chat models get their chat template.",
        epilog=examples(
            'shoal generate "What is the capital of France?"     # the bundled SmolLM2-135M',
            'shoal generate "Write a haiku about fish" --max-tokens 48 --temperature 0.7',
            "shoal generate --file prompts.txt --json             # one JSON line per prompt",
            'shoal generate --model ./Qwen2.5-0.5B-Instruct "Hi" --dtype bfloat16',
        ),
    )
    gen.add_argument("prompt", nargs="*", help="prompts, each answered on its own")
    out = gen.add_argument_group("prompts and sampling")
    out.add_argument("--file", metavar="PATH", help="a file of prompts, one per line")
    out.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most"
    )
    out.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy")
    out.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling")
    out.add_argument(
        "--seed", type=int, default=None, metavar="N", help="makes sampling reproducible"
    )
    out.add_argument("--raw", action="store_true", help="do not apply the chat template")
    out.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    engine_arguments(gen)
    gen.set_defaults(func=_generate)


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="run workload W1 and print shoal's throughput",
        description="Workload W1 on shoal alone: prompts of 32-512 tokens, 128 tokens out, EOS "
        "ignored. benchmarks/w1_throughput.py runs it against vLLM, llama.cpp and transformers.",
        epilog=examples("shoal bench", "shoal bench --dtype bfloat16 --num-requests 16"),
    )
    bench.add_argument(
        "--num-requests", type=int, default=64, metavar="N", help="requests in the workload"
    )
    engine_arguments(bench, backend=False)
    bench.set_defaults(func=_bench)


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
