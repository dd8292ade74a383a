"""The `shoal` command: generate, bench, serve, sessions, keys, batchify, quota, cluster. Thin:
parsing here (one module per subcommand), work elsewhere."""

from __future__ import annotations

import argparse
from typing import cast

from shoal.batchify.cli import add_parser as add_batchify
from shoal.cli.formatting import ShoalParser, examples
from shoal.cli.generate import add_bench, add_generate
from shoal.cli.keys import add_keys
from shoal.cli.serve import add_serve, server_arguments, server_config
from shoal.cli.sessions import add_sessions
from shoal.cluster.cli import add_parser as add_cluster
from shoal.quota.cli import add_parser as add_quota

DESCRIPTION = """\
shoal: batching for LLM workloads. A continuous-batching engine over a paged KV block pool,
an OpenAI- and Anthropic-compatible server with sessions whose KV survives turns and
restarts, client-side batching into provider Batch APIs, and a quota service."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree (the docs' configuration reference is generated from it)."""
    parser = ShoalParser(
        prog="shoal",
        description=DESCRIPTION,
        epilog=examples(
            'shoal generate "What is the capital of France?"',
            "shoal serve --port 8000            # then point an OpenAI or Anthropic client at it",
            "shoal serve --help                 # every subcommand has its own reference",
        ),
    )
    # Its parsers are ShoalParsers; the subcommands' modules need only ArgumentParser's API.
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND"),
    )
    add_generate(sub)
    add_bench(sub)
    add_serve(sub)
    add_sessions(sub)
    add_keys(sub)
    add_batchify(sub)
    add_quota(sub)
    add_cluster(sub, server_arguments, server_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
