"""`shoal quota serve`: the quota service as a standalone HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys

from shoal.quota.errors import QuotaError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    quota = sub.add_parser(
        "quota",
        help="the quota service (shared Reserve/Complete budgets)",
        description="Budgets that jobs calling LLMs share: requests and tokens per window, "
        "concurrent jobs. A job reserves before its call and reports what it used after.",
    )
    commands = quota.add_subparsers(dest="quota_command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a limits file over HTTP",
        description="Serve the limits of a TOML file over HTTP (/v1/reserve, /v1/complete, "
        "their /batch forms, /v1/limits, /v1/usage, /metrics).",
        epilog="examples:\n"
        "  shoal quota serve --config limits.toml --port 8100            # SQLite in ./shoal-data\n"
        "  shoal quota serve --config limits.toml --backend redis://127.0.0.1:6379/0",
    )
    serve.add_argument("--config", required=True, help="the limits TOML file")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8100, help="port to listen on")
    serve.add_argument(
        "--backend",
        default=None,
        help="sqlite:///path.db or redis://host:port/db (default: the config's backend, "
        "else quota.db in --data-dir)",
    )
    serve.add_argument("--data-dir", default="./shoal-data", help="where the SQLite file goes")
    serve.add_argument("--api-key", default=None, help="require this Bearer token")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from shoal.quota.http import create_app
    from shoal.quota.limits import load_config
    from shoal.quota.service import QuotaService

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        service = QuotaService.open(config, backend_url=args.backend, data_dir=args.data_dir)
    except (OSError, QuotaError) as e:
        print(f"shoal quota serve: {e}", file=sys.stderr)
        return 2
    logging.getLogger("shoal.quota").info(
        "%d limits on %s", len(config.limits), service.backend.name
    )
    app = create_app(service, api_key=args.api_key)
    # Idle connections outlive the clients' own keep-alive (httpx: 5 s), so a client never
    # sends on a connection the server is closing at that moment.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30)
    return 0
