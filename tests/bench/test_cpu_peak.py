"""``python -m loraplex.tools.bench.cpu_peak``: the arithmetic peak the benchmarks quote as the
compute floor of a decode step's GEMMs."""

from __future__ import annotations

import pytest

from loraplex.tools.bench import cpu_peak


def test_peaks_are_measured_and_printed(capsys: pytest.CaptureFixture[str]) -> None:
    fma = cpu_peak.peak_gflops("fp32-fma", threads=1, rounds=1)
    assert fma is not None and fma > 1.0  # every x86 build has FMA vectors (AVX2 or AVX-512)
    dot = cpu_peak.peak_gflops("bf16-dot", threads=1, rounds=1)
    # None: this build (an AVX2 one) has no AVX512-BF16 dot products
    assert dot is None or dot > 0.0
    int8 = cpu_peak.peak_gflops("int8-dot", threads=1, rounds=1)
    assert int8 is None or int8 > 0.0  # None: no AVX512-VNNI in this build
    assert cpu_peak.main(["--threads", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "fp32-fma  1 threads:" in out and "bf16-dot  1 threads:" in out
    assert "int8-dot  1 threads:" in out
