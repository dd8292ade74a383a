"""Run the timing-sensitive test modules several times and report the tests that flaked.

`make test-stress` (or `python tests/stress.py --runs 5 --hog`): each run is one pytest
process over the modules below; `--hog` keeps a busy loop pinned to one core for the whole
time, so the tests meet a machine that is slower than they were written on. A test that
fails in some runs and passes in others is a flake: it depends on the machine's speed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

MODULES = [
    "tests/server",
    "tests/cluster",
    "tests/batchify",
    "tests/quota",
    "tests/engine/test_async_engine.py",
    "tests/engine/test_sessions.py",
    "tests/engine/test_sessions_crash.py",
    "tests/engine/test_sessions_schedule.py",
    "tests/engine/test_shared_tier.py",
]
HOG = "while True: pass"


def start_hog() -> subprocess.Popen[bytes]:
    """A busy loop on the first core this process may use."""
    core = min(os.sched_getaffinity(0))
    return subprocess.Popen(
        [sys.executable, "-c", HOG], preexec_fn=lambda: os.sched_setaffinity(0, {core})
    )


def failures(report: Path) -> tuple[int, list[str]]:
    """(tests run, ids of those that failed or errored) from a JUnit XML report."""
    root = ET.parse(report).getroot()
    cases = list(root.iter("testcase"))
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in cases
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return len(cases), failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hog", action="store_true", help="a busy loop pinned to one core")
    p.add_argument("modules", nargs="*", default=MODULES)
    args = p.parse_args()
    hog = start_hog() if args.hog else None
    flaked: Counter[str] = Counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(1, args.runs + 1):
                report = Path(tmp) / f"run-{run}.xml"
                began = time.monotonic()
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                subprocess.run([*cmd, f"--junitxml={report}", *args.modules], check=False)
                ran, failed = failures(report)
                flaked.update(failed)
                took = time.monotonic() - began
                print(f"run {run}/{args.runs}: {ran} tests, {len(failed)} failed, {took:.0f} s")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    for test, n in flaked.most_common():
        print(f"FLAKY {n}/{args.runs}  {test}")
    print("no flakes" if not flaked else f"{len(flaked)} tests failed in some runs")
    return 1 if flaked else 0


if __name__ == "__main__":
    sys.exit(main())
