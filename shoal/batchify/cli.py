"""`shoal batchify [options] script.py [args...]`: run an unmodified script inside a scope.

The scope is process-wide, so calls from the script's threads and thread pools are caught
too, and it closes (submitting what is queued, waiting for every result) when the script ends.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from shoal.batchify.scope import Batchify


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--poll-interval-s", type=float, default=10.0)
    p.add_argument("--max-poll-interval-s", type=float, default=300.0)
    p.add_argument("--cache-path", default=None, help="default: ~/.cache/shoal/")
    p.add_argument("--dry-run", action="store_true", help="no provider I/O, empty replies")
    p.add_argument("--cancel-on-abort", action="store_true")


def run(args: argparse.Namespace) -> int:
    scope = Batchify(
        batch_size=args.batch_size,
        window_s=args.window_s,
        poll_interval_s=args.poll_interval_s,
        max_poll_interval_s=args.max_poll_interval_s,
        cache_path=args.cache_path,
        dry_run=args.dry_run,
        cancel_on_abort=args.cancel_on_abort,
        process_wide=True,
    )
    sys.argv = [args.script, *args.args]
    with scope:
        try:
            runpy.run_path(args.script, run_name="__main__")
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
