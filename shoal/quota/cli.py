"""`shoal quota serve`: the quota service as a standalone HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys

from shoal.quota.errors import QuotaError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    quota = sub.add_parser("quota", help="the quota service (shared Reserve/Complete budgets)")
    commands = quota.add_subparsers(dest="quota_command", required=True)
    serve = commands.add_parser("serve", help="serve a limits file over HTTP")
    serve.add_argument("--config", required=True, help="limits TOML file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument(
        "--backend",
        default=None,
        help="sqlite:///path.db or redis://host:port/db (default: the config's backend, "
        "else quota.db in --data-dir)",
    )
    serve.add_argument("--data-dir", default="./shoal-data")
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
