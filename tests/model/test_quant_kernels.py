"""The quantized Linears against a float64 reference of their weight (``QuantWeight``).

Every candidate the start-up choice may pick (the C kernel's native and AVX2 builds, torch's
int4 and int8 CPU kernels, the dequantizing path, W8A8 int8, float8) is checked on odd sizes
(rows not a multiple of four, one and many rows of x, groups and per channel, with and without
zero points, act order). Tolerances follow the dtype: float32 sums of K products in another
order (1e-5 relative to the largest output), bfloat16 a few roundings of 2^-9 (TOL).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest
import torch

from loraplex.model.quant.cpu_kernel import SOURCE, QGemmKernel, amx_probe_passes, load_qgemm
from loraplex.model.quant.kernels import (
    PROMPT_ROWS,
    CKernelLinear,
    DequantLinear,
    FP8Linear,
    KernelChoice,
    PanelQuantLinear,
    PanelW4A8Linear,
    TorchInt4Linear,
    TorchInt8Linear,
    W8A8Int8Linear,
    build_quant_linear,
    choose_kernel,
    quantize_activation,
)
from loraplex.model.quant.linear import QuantLinearBase
from loraplex.model.quant.weights import ActQuant, FP8Weight, QuantWeight
from loraplex.native.build import AVX2_CPU_FLAGS, KernelBuildError, cpu_flags, find_compiler

# bf16: up to four roundings of 2**-9 each (a bf16 scale, the product, the bias, their sum),
# with a factor 2 of margin
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}

ISAS = ["native"]
if (cpu_flags() or frozenset()).issuperset(AVX2_CPU_FLAGS):
    ISAS.append("avx2")  # the code an AVX2-only CPU runs, built and checked on every x86 CPU

CASES = [  # (out, in, bits, group size (None: per channel), zero points, act order)
    (7, 64, 4, 32, True, False),
    (33, 128, 4, 64, False, False),
    (9, 96, 8, None, False, False),
    (13, 64, 8, 32, True, False),
    (18, 128, 4, 32, True, True),
    (5, 512, 4, None, False, False),  # one group of more than one unpacked chunk
    (10, 96, 4, 64, True, False),  # a short last group (SmolLM2's 576 in groups of 128)
    (6, 160, 8, 64, False, True),
]


def _weight(
    n: int, k: int, bits: int, gs: int | None, zp: bool, act_order: bool, seed: int = 0
) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    qw = QuantWeight.quantize(w, bits, gs, asymmetric=zp, bias=torch.randn(n, generator=g))
    if act_order:  # a stored column order that is not the input's
        from dataclasses import replace

        qw = replace(qw, perm=torch.randperm(k, generator=g))
    return qw


def _check(got: torch.Tensor, x: torch.Tensor, qw: QuantWeight, dtype: torch.dtype) -> None:
    product = x.double() @ qw.dequantize(torch.float64).T
    bias = qw.bias.double() if qw.bias is not None else torch.zeros(product.shape[1])
    want = product + bias
    # the roundings act on the product, the bias and their sum (a kernel adding the bias in
    # bf16 rounds all three): relative to the largest of them
    scale = max(product.abs().max().item(), bias.abs().max().item(), want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs {TOL[dtype] * scale:.3g}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-int{c[2]}-g{c[3]}-zp{c[4]}-ao{c[5]}"
)
def test_c_kernel(isa: str, dtype: torch.dtype, case: tuple) -> None:
    qw = _weight(*case)
    lin = CKernelLinear(qw, load_qgemm(isa=isa))
    for rows in (1, 5, 70):
        x = torch.randn(rows, qw.in_features, generator=torch.Generator().manual_seed(rows)).to(
            dtype
        )
        _check(lin(x), x, qw, dtype)
        lin.dequant_rows = 1  # the prompt path: dequantize row blocks, float GEMM
        lin.BLOCK_ROWS = 4
        _check(lin(x), x, qw, dtype)
        lin.dequant_rows = None


@pytest.mark.parametrize(
    "case",
    [(32, 64, 4, 32, True, False), (48, 128, 4, 64, False, True), (16, 256, 4, None, False, False)],
    ids=str,
)
def test_torch_int4(case: tuple) -> None:  # its layout needs out_features % 16 == 0
    qw = _weight(*case)
    lin = TorchInt4Linear(qw, torch.bfloat16)
    x = torch.randn(6, qw.in_features, generator=torch.Generator().manual_seed(6)).to(
        torch.bfloat16
    )
    _check(lin(x), x, qw, torch.bfloat16)
    assert torch.allclose(lin.dequantize(torch.float32), qw.dequantize(torch.float32), atol=0.05)
    assert lin.nbytes < qw.in_features * qw.out_features  # half a byte a weight + scales


@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        (40, 320, 8, None, True, False),
        (37, 384, 4, 256, True, False),
        (12, 90, 8, None, False, False),
    ],
    ids=lambda c: f"{c[0]}x{c[1]}-int{c[2]}-g{c[3]}-zp{c[4]}-ao{c[5]}",
)
def test_panel_quant(case: tuple) -> None:
    """The panel kernel's 4- and 8-bit path (bf16 x, where this CPU has AVX512-BF16): rows
    around its block of eight, several blocks, and prompt-sized batches that unpack each chunk
    once into a buffer (PAIRS_FROM = 65 rows); groups longer than one chunk (64 pairs), a
    short last group, an odd count of input pairs (8 bits), act order; every row's result the same bits
    whatever the batch; the weight read back exactly from its panels and kept only there."""
    kernel = load_qgemm()
    if not kernel.bf16_dot:
        pytest.skip("no AVX512-BF16 in this CPU's panel build")
    qw = _weight(*case)
    lin = PanelQuantLinear(qw, torch.bfloat16, kernel)
    assert lin.name == f"panel-int{qw.bits}"
    panels, groups = -(-qw.out_features // kernel.panel), qw.scales.shape[1]
    # half a byte (4 bits) or a byte a weight, a float32 scale and an int8 zero point per
    # column and group, columns padded to whole panels
    value_bytes = qw.in_features // 2 if qw.bits == 4 else qw.in_features
    want_bytes = panels * kernel.panel * (value_bytes + 5 * groups)
    assert lin.quant is None and lin.packed.nbytes == want_bytes
    assert torch.equal(lin.dequantize(torch.float64), qw.dequantize(torch.float64))
    x = torch.randn(70, qw.in_features, generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16)
    whole = lin(x)
    _check(whole, x, qw, torch.bfloat16)
    for rows in (1, 4, 8, 9, 16, 64, 65):  # the same chain of sums for a row in any batch
        assert torch.equal(lin(x[:rows]), whole[:rows])
    built = build_quant_linear(
        qw, torch.bfloat16, torch.device("cpu"), KernelChoice(lin.name, {}), None
    )
    assert isinstance(built, PanelQuantLinear)  # what the start-up choice builds by name
    with pytest.raises(KernelBuildError):
        PanelQuantLinear(qw, torch.float32, kernel)  # bf16 x only


AMX_CASES = [  # K and the group size multiples of 32 (a tile reads 32 inputs)
    (40, 256, 4, 128, True, False),
    (33, 128, 4, 32, False, True),
    (18, 96, 8, 32, True, False),
    (5, 512, 4, None, False, False),  # per channel: one group of eight tile steps
    (10, 160, 8, None, False, True),
    (70, 64, 8, 64, False, False),  # three panels, the last one mostly padding
]


def _amx_model() -> QGemmKernel:
    """The kernel with ``native/amx.h``'s software model of the tiles (skips where the CPU
    has no AVX512-BF16: the tiles' panels are built only beside those)."""
    kernel = load_qgemm(isa="amx-model")
    if not kernel.bf16_dot:
        pytest.skip("no AVX512-BF16 in this CPU's panel build")
    assert kernel.amx_compiled and kernel.amx_emulated
    assert kernel.amx, "the tiles' panels failed their check against float64"
    return kernel


@pytest.mark.parametrize(
    "case", AMX_CASES, ids=lambda c: f"{c[0]}x{c[1]}-int{c[2]}-g{c[3]}-zp{c[4]}-ao{c[5]}"
)
def test_panel_quant_on_amx_tiles(case: tuple) -> None:
    """The quantized panels' second path on AMX-BF16 tiles, run through the tiles' software
    model (the same C, every tile operation as Intel's SDM defines it, any misuse counted):
    blocks of 16 rows and a last short one, the reference within bf16's tolerance, the
    AVX-512 path's products in another order, and no misuse of the tiles."""
    kernel = _amx_model()
    qw = _weight(*case)
    lin = PanelQuantLinear(qw, torch.bfloat16, kernel)
    assert lin.alt_name == "amx" and lin.alt_rows is None
    x = torch.randn(40, qw.in_features, generator=torch.Generator().manual_seed(4))
    x = x.to(torch.bfloat16)
    direct = lin(x)
    lin.alt_rows = 2  # from two rows on: one row stays on the AVX-512 path
    assert torch.equal(lin(x[:1]), direct[:1])
    for rows in (2, 15, 16, 17, 33, 40):
        got = lin(x[:rows])
        _check(got, x[:rows], qw, torch.bfloat16)
        assert torch.allclose(got.float(), direct[:rows].float(), rtol=TOL[torch.bfloat16],
                              atol=TOL[torch.bfloat16] * direct.abs().max().item())  # fmt: skip
    assert kernel.amx_faults() == 0


def test_amx_tiles_need_whole_tiles_of_inputs() -> None:
    """K or a group size not a multiple of 32 has no tile path (the AVX-512 panels serve it),
    and the kernel refuses it if asked."""
    kernel = _amx_model()
    qw = _weight(12, 90, 8, None, False, False)
    lin = PanelQuantLinear(qw, torch.bfloat16, kernel)
    assert lin.alt_name is None
    x = torch.randn(3, 90).to(torch.bfloat16)
    with pytest.raises(KernelBuildError):
        kernel.gemm_q(x, lin.packed, 12, 8, 90, 1, None, torch.empty(3, 12).bfloat16(), tiles=True)


def test_amx_probe_runs_in_a_child_process() -> None:
    """The first run of the tiles is a child process's (a fault there costs the child): the
    model's build passes it; a build without tiles has none to offer."""
    kernel = _amx_model()
    assert amx_probe_passes(kernel.library)
    assert not load_qgemm(isa="portable").amx


def test_amx_build_for_the_hardware_compiles(tmp_path: Path) -> None:
    """The tile code as a Xeon with AMX builds it (``-march=sapphirerapids``: the compiler's
    own AMX intrinsics, not the model) compiles and says it has the tiles; it is only loaded
    here, never run (this CPU may lack the instructions)."""
    cc = find_compiler()
    flags = ("-O3", "-march=sapphirerapids", "-fopenmp")
    probe = tmp_path / "t.c"
    probe.write_text("int f(void) { return 0; }\n")
    if cc is None or subprocess.run([cc, *flags, "-c", "-o", os.devnull, str(probe)],
                                    capture_output=True).returncode:  # fmt: skip
        pytest.skip("no compiler that targets Sapphire Rapids")
    lib = tmp_path / "qgemm_amx.so"
    done = subprocess.run(
        [cc, *flags, "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(lib), str(SOURCE)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    features = ctypes.CDLL(str(lib)).loraplex_qgemm_features()
    assert features & 8 and not features & 16  # the tiles, on hardware


W4A8_CASES = [  # 4-bit, K a multiple of 32, groups of a multiple of 8
    (40, 256, 4, 128, False, False),
    (33, 128, 4, 32, True, False),
    (18, 128, 4, 32, True, True),  # act order: x gathered, the per-token scale unchanged
    (5, 512, 4, None, False, False),  # one group per channel
    (10, 96, 4, 64, True, False),  # a short last group
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case", W4A8_CASES, ids=lambda c: f"{c[0]}x{c[1]}-g{c[3]}-zp{c[4]}-ao{c[5]}"
)
def test_panel_w4a8(case: tuple, dtype: torch.dtype) -> None:
    """W4A8 on the panel kernel (AVX512-VNNI): x quantized per token exactly as
    ``quantize_activation`` does (the reference is that activation times the dequantized weight
    in float64), exact int32 group sums; a zero row and an outlier row; every row the same bits
    in any batch; the weight read back exactly; the start-up builds it for a W4A8 weight."""
    from dataclasses import replace

    kernel = load_qgemm()
    if not kernel.w4a8:
        pytest.skip("no AVX512-VNNI in this CPU's panel build")
    qw = replace(_weight(*case), act=ActQuant("int8"))
    lin = build_quant_linear(qw, dtype, torch.device("cpu"), None, None)
    assert lin.name == "panel-w4a8" and lin.quant is None
    panels, groups = -(-qw.out_features // kernel.panel), qw.scales.shape[1]
    # half a byte a weight, a float32 scale and an int8 zero point a column and group
    perm = qw.perm.nbytes if qw.perm is not None else 0
    assert lin.nbytes == panels * kernel.panel * (qw.in_features // 2 + 5 * groups) + perm
    assert torch.equal(lin.dequantize(torch.float64), qw.dequantize(torch.float64))
    x = torch.randn(19, qw.in_features, generator=torch.Generator().manual_seed(5))
    x[3] = 0.0  # absmax 0: the scale's floor, xq all zero
    x[4, 7] = 300.0  # an outlier: the row's other entries round to few levels
    x = x.to(dtype)
    got = lin(x)
    want_x = quantize_activation(x, ActQuant("int8")).double()
    product = want_x @ qw.dequantize(torch.float64).T
    bias = qw.bias.double()
    want = product + bias
    scale = max(product.abs().max().item(), bias.abs().max().item(), want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs {TOL[dtype] * scale:.3g}"
    assert torch.equal(got[3], bias.to(dtype))  # a zero row is the bias
    for rows in (1, 8, 9, 16):
        assert torch.equal(lin(x[:rows]), got[:rows])
    # the emulated path (other CPUs, CUDA) computes the same product
    emulated = DequantLinear(qw)(x)
    assert (emulated.double() - want).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    [(40, 256, 4, 128, False, False), (33, 128, 4, 64, True, True), (5, 512, 4, None, True, False)],
    ids=lambda c: f"{c[0]}x{c[1]}-g{c[3]}-zp{c[4]}-ao{c[5]}",
)
def test_panel_w4a8_on_amx_int8_tiles(case: tuple, dtype: torch.dtype) -> None:
    """W4A8's second path on AMX-INT8 tiles (through the tiles' software model): the same
    exact int32 sums as on VNNI, so the same bits for every row count around the tiles' 16,
    a zero row and an outlier; the start-up times it on a probe of the weight's kind."""
    from dataclasses import replace

    from loraplex.model.quant import kernels

    kernel = _amx_model()
    assert kernel.amx_int8
    qw = replace(_weight(*case), act=ActQuant("int8"))
    lin = PanelW4A8Linear(qw, kernel)
    assert lin.alt_name == "amx-int8"
    x = torch.randn(35, qw.in_features, generator=torch.Generator().manual_seed(6))
    x[3] = 0.0
    x[4, 7] = 300.0
    x = x.to(dtype)
    direct = lin(x)
    lin.alt_rows = 2
    assert torch.equal(lin(x[:1]), direct[:1])
    for rows in (2, 15, 16, 17, 35):
        assert torch.equal(lin(x[:rows]), direct[:rows])
    assert kernel.amx_faults() == 0
    factory = kernels.QuantKernels(torch.device("cpu"), dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "usable_quant_panels", lambda: kernel)
        built = factory(qw)
    assert isinstance(built, PanelW4A8Linear) and built.alt_name == "amx-int8"
    assert "amx-int8@16" in factory.summary()
    narrow = replace(_weight(10, 96, 4, 32, True, False), act=ActQuant("int8"))
    assert PanelW4A8Linear(narrow, kernel).alt_name is None  # 96 inputs: no whole tiles


def test_torch_int4_refuses_what_its_layout_cannot_hold() -> None:
    from loraplex.native.build import KernelBuildError

    for case in ((7, 64, 4, 32, True, False), (16, 512, 4, None, False, False)):
        with pytest.raises(KernelBuildError):
            TorchInt4Linear(_weight(*case), torch.bfloat16)


def test_torch_int8_per_channel_only() -> None:
    qw = _weight(9, 96, 8, None, False, False)
    lin = TorchInt8Linear(qw, torch.bfloat16)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    _check(lin(x), x, qw, torch.bfloat16)
    from loraplex.native.build import KernelBuildError

    with pytest.raises(KernelBuildError):  # grouped: not this kernel's layout
        TorchInt8Linear(_weight(13, 64, 8, 32, True, False), torch.bfloat16)
    with pytest.raises(KernelBuildError):  # float32 x: not offered
        TorchInt8Linear(qw, torch.float32)


def test_rtn_quantization_error_is_half_a_step() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=g)
    for bits, gs, zp in ((4, 32, False), (4, 64, True), (8, None, False), (8, 32, True)):
        qw = QuantWeight.quantize(w, bits, gs, asymmetric=zp)
        err = (qw.dequantize(torch.float64) - w.double()).abs()  # [N, K]
        step = qw.scales.double().repeat_interleave(qw.group_size, dim=1)
        assert bool((err <= step / 2 + 1e-6).all()), (bits, gs, zp)
        assert torch.equal(QuantWeight.pack(qw.values(), bits), qw.q)  # the layout round-trips


def test_start_up_choice_picks_a_checked_kernel() -> None:
    qw = _weight(64, 128, 4, 32, False, False)
    for dtype in (torch.float32, torch.bfloat16):
        choice = choose_kernel(qw, dtype, load_qgemm())
        assert choice.name in choice.times_ms  # timed, after passing its self-check
        if dtype == torch.float32:  # torch's int4/int8 kernels are not offered float32 x
            assert not {"torch-int4", "torch-int8"} & set(choice.times_ms)


def test_int_mm_check_tells_saturation_from_exact() -> None:
    """The check behind W8A8's kernel choice agrees with an int64 product of full-range
    operands in this process (wrong under oneDNN's AVX2 code, where ``_int_mm`` saturates)."""
    from loraplex.model.quant.kernels import int_mm_is_exact

    g = torch.Generator().manual_seed(9)
    a = torch.randint(-128, 128, (9, 2048), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (2048, 24), dtype=torch.int8, generator=g)
    agrees = torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    assert int_mm_is_exact() == agrees


def test_w8a8_int8_quantizes_only_the_base_input() -> None:
    qw = _weight(24, 64, 8, None, False, False)
    from dataclasses import replace

    qw = replace(qw, act=ActQuant("int8"))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    x_before = x.clone()
    want = (
        quantize_activation(x, qw.act).double() @ qw.dequantize(torch.float64).T + qw.bias.double()
    )
    exact = W8A8Int8Linear(qw)
    emulated = W8A8Int8Linear(qw, load_qgemm())
    emulated.wt = None  # the path of a CPU where _int_mm saturates (int_mm_is_exact False)
    plain = W8A8Int8Linear(qw)
    plain.wt = None  # ... without the C kernel
    for lin in (exact, emulated, plain):
        got = lin(x)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), lin.name
    assert torch.equal(x, x_before)  # the LoRA delta reads this x, unquantized
    assert (quantize_activation(x, qw.act) - x).abs().max() > 1e-3  # the quantization is real
    ref = DequantLinear(qw)(x)
    assert (ref.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("act", [None, ActQuant("fp8", 0.01), ActQuant("fp8")])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8(act: ActQuant | None, per_channel: bool) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(12, 64, generator=g) * 0.1
    scale = (w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)) / 448
    fw = FP8Weight((w / scale).to(torch.float8_e4m3fn), scale.float(), act)
    x = torch.randn(3, 64, generator=g)
    x_before = x.clone()
    got = FP8Linear(fw)(x)
    xin = x if act is None else quantize_activation(x, act)
    want = xin.double() @ fw.dequantize(torch.float64).T
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(x, x_before)
    fused = FP8Weight.cat([fw, fw])
    assert torch.equal(fused.dequantize(), torch.cat([fw.dequantize(), fw.dequantize()]))


class _Timed(QuantLinearBase):
    """A candidate whose two paths compute the reference and whose time per path and row
    count is a table (the start-up choice's logic, without a clock)."""

    last: tuple[str, int] = ("", 0)

    def __init__(self, qw: QuantWeight, name: str, alt_name: str | None) -> None:
        super().__init__(qw)
        self.name, self.alt_name = name, alt_name
        self.w = qw.dequantize(torch.float64)

    def _ref(self, path: str, x: torch.Tensor) -> torch.Tensor:
        _Timed.last = (path, x.shape[0])
        return (x.double() @ self.w.T).to(x.dtype)  # the probe weight has no bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ref(self.name, x)

    def alt(self, x: torch.Tensor) -> torch.Tensor:
        assert self.alt_name is not None
        return self._ref(self.alt_name, x)


def test_start_up_choice_takes_each_candidates_faster_path_per_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each candidate is timed at every decode size on the faster of its paths (one stored
    weight serves both): the C kernel's dequantizing path where it wins at 16 rows, the AMX
    tiles from 16 rows where they lose at one; the fastest sum over the sizes wins, its second
    path from the fewest rows it won at, every time reported per row count."""
    from loraplex.model.quant import kernels

    table = {
        ("c-kernel", 1): 0.2, ("c-kernel", 16): 1.578, ("dequant", 1): 1.0,
        ("dequant", 16): 0.6, ("panel-int4", 1): 0.15, ("panel-int4", 16): 1.05,
        ("amx", 1): 0.4, ("amx", 16): 0.3,
    }  # fmt: skip
    qw = _weight(64, 128, 4, 32, False, False)

    def candidates(w: QuantWeight, dtype: torch.dtype, kernel: object) -> list[_Timed]:
        return [_Timed(w, "c-kernel", "dequant"), _Timed(w, "panel-int4", "amx")]

    def clock(fn: object, repeats: int = 5) -> float:
        fn()  # type: ignore[operator]
        return table[_Timed.last]

    monkeypatch.setattr(kernels, "_candidates", candidates)
    monkeypatch.setattr(kernels, "_time_ms", clock)
    choice = choose_kernel(qw, torch.bfloat16, None)
    assert (choice.name, choice.alt_name, choice.alt_rows) == ("panel-int4", "amx", 16)
    assert choice.times_ms["panel-int4"] == pytest.approx(0.15 + 0.3)
    assert choice.times_ms["c-kernel"] == pytest.approx(0.2 + 0.6)
    assert {"c-kernel@1", "dequant@16", "panel-int4@16", "amx@1"} <= set(choice.times_ms)
    table[("amx", 16)] = 1.2  # the tiles lose everywhere: the C kernel + dequant wins
    table[("amx", PROMPT_ROWS)] = table[("panel-int4", PROMPT_ROWS)] = 1.0
    choice = choose_kernel(qw, torch.bfloat16, None)
    assert (choice.name, choice.alt_name, choice.alt_rows) == ("c-kernel", "dequant", 16)
    table[("dequant", 16)] = 2.0  # and nothing's second path wins at a decode size
    table[("dequant", PROMPT_ROWS)], table[("c-kernel", PROMPT_ROWS)] = 5.0, 9.0
    choice = choose_kernel(qw, torch.bfloat16, None)
    assert (choice.name, choice.alt_rows) == ("panel-int4", None)
    built = build_quant_linear(
        qw, torch.bfloat16, torch.device("cpu"),
        KernelChoice("c-kernel", {}, 64, "dequant"), load_qgemm(),
    )  # fmt: skip
    assert isinstance(built, CKernelLinear) and built.dequant_rows == 64
