"""The axes every greedy-vs-transformers case runs along (a module opts in with
`pytestmark = pytest.mark.usefixtures("cpu_path", "speculation", "decode_graphs")`)."""

from __future__ import annotations

import greedy_cases
import pytest

from shoal.layers import cpu_kernels


@pytest.fixture(params=["kernels", "torch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case runs with shoal's C++ kernels (attention, norms, rotary, SiLU) and without
    them (pure torch, as on a machine with no compiler)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "native", lambda: None)
    elif greedy_cases.DEVICE != "cpu":
        pytest.skip(f"the C++ kernels run on the CPU, not {greedy_cases.DEVICE}")
    elif cpu_kernels.native() is None:
        pytest.skip("no C++ compiler for the kernels")


@pytest.fixture(params=[0, 4], ids=["plain", "speculative"])
def speculation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every case runs without and with prompt-lookup speculation (up to 4 drafts a step):
    verified drafts must change nothing the engine returns."""
    monkeypatch.setattr(greedy_cases, "SPECULATIVE_TOKENS", request.param)
    return int(request.param)


@pytest.fixture(params=["eager", "graphs"])
def decode_graphs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every case runs with decode steps replaying CUDA graphs and without them
    (`enforce_eager`); elsewhere every step is eager."""
    if request.param == "graphs" and greedy_cases.DEVICE == "cpu":
        pytest.skip("CUDA graphs need SHOAL_TEST_DEVICE=cuda and a GPU")
    monkeypatch.setattr(greedy_cases, "ENFORCE_EAGER", request.param == "eager")
