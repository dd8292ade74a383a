"""The paths that follow from what /proc/cpuinfo says."""

from __future__ import annotations

import pytest

from shoal.layers import cpu_features


@pytest.mark.parametrize(
    ("vendor", "flags", "pays"),
    [
        ("AuthenticAMD", {"avx512f", "avx512_bf16"}, True),  # Zen 4/5: VDPBF16PS twice an FMA
        ("GenuineIntel", {"avx512f", "avx512_bf16", "amx_bf16"}, False),  # two FMA pipes
        ("AuthenticAMD", {"avx2", "fma"}, False),  # Zen 3: no bfloat16 dot products
        ("", {"bf16", "asimd"}, False),  # Arm: no x86 tiles at all
    ],
)
def test_bf16_attention_tiles_only_where_they_outrun_fmas(
    vendor: str, flags: set[str], pays: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_features, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    assert cpu_features.bf16_tiles_pay() is pays


def test_this_cpu_reads_its_vendor_and_flags() -> None:
    if not cpu_features.is_x86():
        pytest.skip("Arm's /proc/cpuinfo names no vendor")
    assert cpu_features.cpu_vendor() in {"GenuineIntel", "AuthenticAMD", "HygonGenuine"}
    assert "sse2" in cpu_features.cpu_flags()
