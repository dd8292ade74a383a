"""The benchmark scripts' plotting helper (`benchmarks/plotting.py`) writes the PNGs the
scripts promise, from the shapes of data they pass it; without matplotlib it writes nothing
and says why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# The scripts import it as a sibling module (they run from benchmarks/); load it the same way.
_spec = importlib.util.spec_from_file_location(
    "plotting", Path(__file__).resolve().parents[1] / "benchmarks" / "plotting.py"
)
assert _spec is not None and _spec.loader is not None
plotting = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plotting)

PNG = b"\x89PNG\r\n\x1a\n"


def test_each_kind_of_plot_is_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra is not installed")
    rates = {"float32": {"shoal": 195.7, "vLLM": 177.1}, "bfloat16": {"shoal": 370.6}}
    plotting.bars(tmp_path / "w1.png", "W1", rates, "output tokens/s", note="a CPU")
    ttft = {"sessions": ([1, 2, 3], [3.6, 2.2, 1.5]), "baseline": ([1, 2, 3], [3.3, 2.7, 3.0])}
    plotting.lines(tmp_path / "w2.png", "W2", ttft, "turn", "mean TTFT (s)")
    by_size = {"shoal": ([1, 2, 4, 8], [20.0, 38.0, 70.0, 120.0])}
    plotting.lines(tmp_path / "b.png", "decode", by_size, "batch size", "tokens/s", logx=True)
    plotting.cdf(tmp_path / "r.png", "restore", {"contiguous": [2.4, 2.5, 4.0]}, "ms")
    said = capsys.readouterr().out
    for name in ("w1.png", "w2.png", "b.png", "r.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG), name
        assert f"plot: {tmp_path / name}" in said  # beside the table the script printed


def test_a_second_plot_goes_beside_the_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert plotting.beside("out/w2.png", "restore") == "out/w2_restore.png"
    assert plotting.beside("", "restore") == ""  # --plot '': no plots at all
    plotting.bars("", "W1", {"float32": {"shoal": 1.0}}, "tokens/s")
    assert "plot:" not in capsys.readouterr().out
