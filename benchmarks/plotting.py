"""The benchmark scripts' plots: one PNG beside each printed table (matplotlib, the `bench`
extra). Without matplotlib a script still prints its table and says how to get the plot.

    bars(path, title, {"float32": {"shoal": 195.7, "vLLM": 177.1}}, "output tokens/s")
    lines(path, title, {"shoal": ([1, 2, 3], [0.4, 0.2, 0.2])}, "turn", "mean TTFT (s)")
    cdf(path, title, {"contiguous ids": [0.0021, ...]}, "restore latency (s)")
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Series = tuple[Sequence[float], Sequence[float]]


def add_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """`--plot PATH`: where the script's PNG goes (default `<name>.png` here; '' for none)."""
    parser.add_argument(
        "--plot", default=f"{name}.png", metavar="PATH", help="the PNG to write ('' for none)"
    )


def beside(path: str, what: str) -> str:
    """A second plot's path next to the first's: `w2_sessions.png` -> `w2_sessions_restore.png`."""
    return str(Path(path).with_stem(f"{Path(path).stem}_{what}")) if path else ""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        print("plot: matplotlib is not installed (pip install 'shoal[bench]'); no PNG written")
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def bars(
    path: str | Path,
    title: str,
    groups: Mapping[str, Mapping[str, float]],
    ylabel: str,
    note: str = "",
) -> None:
    """Grouped bars: one group per key of `groups` (a dtype, a run, a metric), one bar per
    key of its mapping (an engine, a setup), each bar labelled with its value."""
    if not path or (plt := _pyplot()) is None:
        return
    names = list(dict.fromkeys(n for g in groups.values() for n in g))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(min(10.0, 3.0 + 1.4 * len(groups)), 4.5))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ys = [groups[k].get(name, 0.0) for k in groups]
        drawn = ax.bar(xs, ys, width, label=name)
        ax.bar_label(drawn, labels=[f"{y:.3g}" if y else "" for y in ys], fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="gray")
    _save(plt, fig, path)


def lines(
    path: str | Path,
    title: str,
    series: Mapping[str, Series],
    xlabel: str,
    ylabel: str,
    logx: bool = False,
) -> None:
    """One line per series (x, y): throughput by batch size, TTFT by turn."""
    if not path or (plt := _pyplot()) is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if all(float(x).is_integer() for xs, _ in series.values() for x in xs):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # turns, batch sizes
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def cdf(path: str | Path, title: str, samples: Mapping[str, Sequence[float]], xlabel: str) -> None:
    """Empirical CDFs: the share of samples at or below each value."""
    if not path or (plt := _pyplot()) is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in samples.items():
        xs = sorted(values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of samples")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)
