"""`shoal batchify [options] script.py [args...]`: run an unmodified script inside a scope.

The scope is process-wide, so calls from the script's threads and thread pools are caught
too, and it closes (submitting what is queued, waiting for every result) when the script ends.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from shoal.batchify.scope import Batchify


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "batchify",
        help="run a script; its SDK calls become Batch API jobs",
        description="Run an unmodified Python script whose openai/anthropic SDK calls travel as "
        "provider Batch API jobs (half price at the big providers); each call still gets its "
        "own typed result. Re-running it after a crash resumes its batches.",
        epilog="examples:\n"
        "  shoal batchify my_script.py --its-own-args\n"
        "  shoal batchify --window-s 2 --batch-size 500 my_script.py\n"
        "  shoal batchify --dry-run my_script.py      # no provider I/O: empty replies",
    )
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    q = p.add_argument_group("batches")
    q.add_argument("--batch-size", type=int, default=1000, help="calls a batch holds at most")
    q.add_argument(
        "--window-s",
        type=float,
        default=2.0,
        help="a queue goes out this long after its first call",
    )
    q.add_argument(
        "--poll-interval-s", type=float, default=10.0, help="first wait between status polls"
    )
    q.add_argument(
        "--max-poll-interval-s", type=float, default=300.0, help="longest wait between polls"
    )
    q.add_argument(
        "--cache-path", default=None, help="the crash-safe ledger (default: ~/.cache/shoal/)"
    )
    q.add_argument("--dry-run", action="store_true", help="no provider I/O, empty replies")
    q.add_argument(
        "--cancel-on-abort",
        action="store_true",
        help="cancel running batches when the script ends with an exception",
    )
    p.set_defaults(func=run)


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
