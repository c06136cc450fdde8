"""The W4A8 kernels (`kimi3_kernels.mxfp4.w4a8`: the MXFP8 quantiser and the FP8 grouped GEMM) under
TRITON_INTERPRET=1 on the CPU: the quantiser gives the emulation's codes and scales (`transformers_kimi3.mxfp8`) bit for
bit, the GEMM equals the PyTorch reference on the dequantised MXFP8 activations, and the packed experts with
`activation_format="mxfp8"` equal their exact emulated path.

As in test_mxfp4_triton.py, the checks run in a subprocess with TRITON_INTERPRET set (this file is its script).
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kimi3_testing import interpreted_results, run_decode_ptx

ROOT = Path(__file__).resolve().parents[2]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _quantiser_checks(w4a8, EM, torch):
    """{case: codes and scales equal to the emulation's}; the cases hold the OCP rules' edges."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(37, 96, generator=gen) * torch.logspace(-30, 30, 96)[None, :]
    edges = torch.ones(8, 64)
    edges[0, :32] = 0.0  # an all-zero block: scale byte 0x00
    edges[1, :32] = -0.0  # negative zeros keep their sign
    # saturation (448 and above), ties between E4M3 neighbours at 1.0 and 0.5 scale (1.0625: between 1 and 1.125,
    # to even = 1; 1.1875: to 1.25), subnormal E4M3 (2^-9 and half of it: a tie to zero), in a block of amax 448
    edges[2, :12] = torch.tensor([448.0, 464.0, 480.0, 511.9, -449.0, 1.0625, 1.1875, -1.0625, 2 ** -9, 2 ** -10,
                                  3 * 2 ** -10, 0.5])
    edges[3, 32:] = 2.0 ** -130  # fp32 subnormals: the smallest scale 2^-127
    edges[4, :32] = 7.0  # all equal
    edges[5, :32] = torch.arange(32) * -0.37
    edges[6, 32:] = 3.0e38  # near fp32's largest
    edges[7, :32] = 1e-40
    out = {}
    for name, x in {"wide_fp32": wide, "edges_fp32": edges, "bf16": (wide[:9] * 1e-20).bfloat16(),
                    "fp16": (torch.randn(9, 64, generator=gen) * 100).half(), "one_row": wide[:1]}.items():
        q, s = w4a8.quantize_mxfp8(x)
        qe, se = EM.quantize_mxfp8(x)
        out[f"quant_{name}"] = [torch.equal(q.view(torch.uint8), qe.view(torch.uint8)), torch.equal(s, se)]
    strided = wide[:, :64]  # a view with a row stride wider than K
    q, s = w4a8.quantize_mxfp8(strided)
    qe, se = EM.quantize_mxfp8(strided.contiguous())
    out["quant_strided"] = [torch.equal(q.view(torch.uint8), qe.view(torch.uint8)), torch.equal(s, se)]
    bad = wide[:4].clone()
    bad[2, 5] = float("nan")
    try:
        w4a8.quantize_mxfp8(bad, "test tensor")
        out["quant_nan_refused"] = ""
    except RuntimeError as ex:
        out["quant_nan_refused"] = str(ex)
    try:
        w4a8.quantize_mxfp8(torch.ones(3, 40), "odd tensor")
        out["quant_shape_refused"] = ""
    except ValueError as ex:
        out["quant_shape_refused"] = str(ex)
    return out


def _gemm_checks(G, w4a8, EM, torch):
    """{case: relative error of the W4A8 GEMM against the reference on the dequantised activations}."""
    R = G.mxfp4_grouped_gemm_ref
    gen = torch.Generator().manual_seed(1)

    def weights(E, rows, cols):
        p = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, generator=gen)
        s = torch.randint(118, 128, (E, rows, cols // 32), dtype=torch.uint8, generator=gen)
        return p, s

    E, N, T, k = 5, 96, 9, 3
    idx = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert E-1 unused
    idx[:6, 0] = 0  # expert 0 has more rows than a 16-row tile
    flat = idx.flatten()
    sorted_e, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(E + 1)).to(torch.int32)
    rows = dict(a_rows=(order // k).to(torch.int32), c_rows=order.to(torch.int32), num_c_rows=flat.numel())
    out = {}
    for K, cfgs in ((96, {"default": None, "bk32": dict(BM=16, BN=32, BK=32)}),
                    (128, {"default": None, "bk64": dict(BM=32, BN=64, BK=64), "bk128": dict(BM=16, BN=32, BK=128)})):
        x = torch.randn(T, K, generator=gen).bfloat16()
        q, s = w4a8.quantize_mxfp8(x)
        xd = EM.dequantize_mxfp8(q, s)
        wp, ws = weights(E, N, K)
        bp, bs = weights(E, N, K)
        two = dict(b_packed=bp, b_scale=bs)
        for mode, kw in {"plain": {}, "dual_out": dict(dual="out", **two), "silu": dict(dual="out", act="silu", **two),
                         "situ": dict(dual="out", act="situ", act_params=(4.0, 25.0), **two),
                         "situ_linear_up": dict(dual="out", act="situ", act_params=(4.0, None), **two)}.items():
            for cname, cfg in cfgs.items():
                if cname != "default" and mode not in ("plain", "situ"):
                    continue
                c = G.mxfp4_grouped_gemm(q, wp, ws, offs, a_scale=s, config=cfg, **rows, **kw)
                out[f"gemm_K{K}_{mode}_{cname}"] = _rel(c, R(xd, wp, ws, offs, **rows, **kw))
        # one route per program from the expert ids (decode), an id past the last expert: a zero row
        ids = flat.to(torch.int32).clone()
        ids[4] = E
        kw = dict(expert_ids=ids, a_row_div=k, dual="out", act="silu", **two)
        c = G.mxfp4_grouped_gemm(q, wp, ws, None, a_scale=s, **kw)
        out[f"gemm_K{K}_row_expert"] = _rel(c, R(xd, wp, ws, None, **kw))
        out[f"gemm_K{K}_row_expert_zero_row"] = bool((c[4] == 0).all())
    refusals = {"scale_shape": dict(a_scale=s[:, :2]), "trans_w": dict(a_scale=s, trans_w=True),
                "a_kperm": dict(a_scale=s, a_kperm=64), "dual_in": dict(a_scale=s, dual="in", a2=q, **two),
                "tile_bk": dict(a_scale=s, config=dict(BM=16, BN=32, BK=48))}
    for name, kw in refusals.items():
        try:
            G.mxfp4_grouped_gemm(q, wp, ws, offs, **rows, **kw)
            out[f"refused_{name}"] = ""
        except ValueError as ex:
            out[f"refused_{name}"] = str(ex)
    return out


def _module_checks(torch):
    """PackedMXFP4Experts(activation_format="mxfp8") on the W4A8 kernels vs its exact emulated path."""
    from transformers_kimi3 import kernels
    from transformers_kimi3.activations import GLUActivation
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    out = {}
    E, D, I, k = 6, 64, 96, 3
    gen = torch.Generator().manual_seed(2)
    w1, w3 = torch.randn(E, I, D, generator=gen) * 0.1, torch.randn(E, I, D, generator=gen) * 0.1
    w2 = torch.randn(E, D, I, generator=gen) * 0.1
    for name, act in {"situ": GLUActivation("situ", 4.0, 25.0), "unfused": lambda g, u: torch.relu(g) * u}.items():
        mod = PackedMXFP4Experts.from_float(w1, w3, w2, act)
        mod.activation_format = "mxfp8"
        # 6 routes: one route per program; 21: sorted segments. fp16: the interpreter rounds it to nearest even as
        # the GPU and PyTorch do (its bf16 conversion truncates); bf16 once
        # bf16 twice: its MXFP8 values through the bf16-activation kernels (the default) and the FP8 kernels
        for T, dtype, gemm in ((2, torch.float16, "values"), (7, torch.float16, "values"),
                               (2, torch.bfloat16, "values"), (7, torch.bfloat16, "values"), (7, torch.bfloat16, "fp8")):
            idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
            tw = torch.rand(T, k, generator=gen)
            x = torch.randn(T, D, generator=gen).to(dtype)
            mod._MXFP8_GEMM = gemm
            kernels.kernel_device = lambda t: True  # the kernels on CPU tensors (under the interpreter)
            with torch.no_grad():
                y = mod(x, idx, tw)
            launched = [mod._kernels(x) is not None, mod._fp8_gemm(dtype)]
            kernels.kernel_device = lambda t: False
            with torch.no_grad():
                ref = mod(x, idx, tw)
            out[f"module_{name}_T{T}_{str(dtype)[6:]}" + ("_fp8" if gemm == "fp8" else "")] = [launched, _rel(y, ref)]
        # with autograd the kernels stand aside: the emulated path, gradients straight through
        kernels.kernel_device = lambda t: True
        xg = x.clone().requires_grad_()
        y = mod(xg, idx, tw)
        y.float().sum().backward()
        out[f"module_{name}_grad_equal_emulation"] = [mod._kernels(xg, grad=True) is None,
                                                      torch.equal(y.detach(), ref), bool(xg.grad.abs().sum() > 0)]
    return out


def _worker():
    for p in (ROOT / "src", ROOT / "kernels"):
        sys.path.insert(0, str(p))
    import torch

    import kimi3_kernels.mxfp4 as G
    from kimi3_kernels.mxfp4 import w4a8
    from transformers_kimi3 import mxfp8 as EM

    res = {"interpreter": G.gemm.interpreter_enabled(), "available_cpu": G.w4a8_available("cpu")}
    res.update(_quantiser_checks(w4a8, EM, torch))
    res.update(_gemm_checks(G, w4a8, EM, torch))
    res.update(_module_checks(torch))
    print("RESULT " + json.dumps(res))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("triton", reason="triton is not installed")
    return interpreted_results(tmp_path_factory, "w4a8_triton", __file__)


def test_interpreter_active(results):
    assert results["interpreter"] and results["available_cpu"]


def test_quantiser_equals_the_emulation_bit_for_bit(results):
    quant = {k: v for k, v in results.items() if k.startswith("quant_") and isinstance(v, list)}
    assert len(quant) == 6 and all(v == [True, True] for v in quant.values()), quant


def test_quantiser_refuses_what_it_cannot_encode(results):
    assert "test tensor" in results["quant_nan_refused"] and "NaN" in results["quant_nan_refused"], results
    assert "odd tensor" in results["quant_shape_refused"] and "multiple of 32" in results["quant_shape_refused"]


def test_gemm_equals_reference_on_dequantised_activations(results):
    # exact products (E4M3 x E4M3 values, power-of-two scales), fp32 sums per 32-column block then across blocks
    # where the reference sums in one pass: rounding differences only (measured ~1e-8; a wrong scale, expert or
    # row is O(1)), bound 1e-6
    gemm = {k: v for k, v in results.items() if k.startswith("gemm_") and not k.endswith("zero_row")}
    assert len(gemm) == 18, sorted(gemm)
    bad = {k: v for k, v in gemm.items() if not v < 1e-6}
    assert not bad, bad
    assert results["gemm_K96_row_expert_zero_row"] and results["gemm_K128_row_expert_zero_row"]


def test_gemm_refuses_layouts_it_does_not_compute(results):
    assert "a_scale must be uint8" in results["refused_scale_shape"], results
    for name in ("trans_w", "a_kperm", "dual_in"):
        assert "forward layouts" in results[f"refused_{name}"], (name, results[f"refused_{name}"])
    assert "whole 32-column K blocks" in results["refused_tile_bk"], results["refused_tile_bk"]


def test_packed_experts_w4a8_kernels_equal_the_emulation(results):
    for name in ("situ", "unfused"):
        for T in (2, 7):
            # fp16: the same MXFP8 codes of x and of the GLU output, exact products, fp32 sums in another order:
            # measured 0 (bound 1e-6)
            launched, err = results[f"module_{name}_T{T}_float16"]
            assert launched == [True, True] and err < 1e-6, (name, T, err)
        # bf16, on the bf16-activation kernels (its MXFP8 values, the default) and on the FP8 kernels: the
        # interpreter truncates bf16 outputs (the GLU output among them) where the emulation rounds them to nearest,
        # and re-quantising to E4M3 (3 mantissa bits) turns a truncated value near a rounding midpoint into a code
        # one E4M3 step (2^-3) away: measured 4e-3 to 3e-2 with other seeds (a wrong scale, row or expert is O(1))
        for key, fp8 in ((f"module_{name}_T2_bfloat16", False), (f"module_{name}_T7_bfloat16", False),
                         (f"module_{name}_T7_bfloat16_fp8", True)):
            launched, err = results[key]
            assert launched == [True, fp8] and err < 5e-2, (key, launched, err)
        # training takes the emulation: identical output, gradients reach x
        assert results[f"module_{name}_grad_equal_emulation"] == [True, True, True], results


def _e4m3_code_of_e2m1(c):
    """The E4M3 code of E2M1 code c (sEEM), from the values: the reference of both weight decodes."""
    e2m1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    v = e2m1[c & 7]
    if v == 0:
        code = 0
    elif v < 1:  # 0.5 = 2^-1: exponent field -1 + 7
        code = 6 << 3
    else:
        e = int(v).bit_length() - 1  # 1, 1.5 -> 0; 2, 3 -> 1; 4, 6 -> 2
        code = ((e + 7) << 3) | (4 if v / 2 ** e == 1.5 else 0)
    return code | ((c & 8) << 4)


def test_ptx_weight_decode_gives_the_e4m3_codes():
    """The GPU kernel's byte-lookup decode (its PTX run by the few-opcode emulator of kimi3_testing) on every byte in
    every position of a word and on random words: each byte's two nibbles become the E4M3 codes of their values, in
    column order."""
    import random

    for p in (ROOT / "src", ROOT / "kernels"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    from kimi3_kernels.mxfp4.w4a8 import E2M1_TO_E4M3_PTX

    asm = E2M1_TO_E4M3_PTX.replace("$2", "$4")  # the emulator's input register
    rng = random.Random(0)
    words = [b << (8 * i) for b in range(256) for i in range(4)] + [rng.getrandbits(32) for _ in range(500)]
    for x in words:
        out = run_decode_ptx(asm, x, [], n_out=2)
        got = [out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16]
        want = [_e4m3_code_of_e2m1(b & 15) | (_e4m3_code_of_e2m1(b >> 4) << 8)
                for b in ((x >> (8 * i)) & 0xFF for i in range(4))]
        assert got == want, (hex(x), [hex(g) for g in got], [hex(w) for w in want])


def _compile_sm90(BM, dual):
    """The W4A8 kernel of the default tile of height BM (gate+up with SiTU fused, or down) compiled for sm_90:
    (its SASS, its resource usage)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kimi3_kernels.mxfp4 import w4a8

    tile = w4a8.a8_tile(BM, 3072)
    kern = w4a8._w4a8_grouped_gemm_kernel
    consts = dict(BM=BM, BN=tile["BN"], BK=tile["BK"], E_CHUNK=1024, NUM_E_CHUNKS=1, DUAL=int(dual),
                  ACT=2 if dual else 0, LINEAR_UP=False, GATHER_A=dual, A_DIV=1, SCATTER_C=not dual, ROW_EXPERT=False,
                  PTX=True)
    sig, attrs = {}, {}
    for i, a in enumerate(kern.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        sig[a] = ("fp32" if a.startswith("beta") else "*bf16" if a == "c_ptr" else "*i32" if a in (
            "a_rows_ptr", "lo_ptr", "hi_ptr", "bcum_ptr", "eid_ptr", "c_rows_ptr") else "*u8" if a.endswith("_ptr")
            else "i32")
        attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=tile["num_warps"], num_stages=tile["num_stages"]))
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.check_output([cuobjdump, "-sass", f.name]).decode()
        res = subprocess.check_output([cuobjdump, "-res-usage", f.name]).decode()
    return sass, res


@pytest.mark.parametrize("BM", [16, 32, 64, 128])
@pytest.mark.parametrize("dual", [True, False])
def test_tiles_compile_to_fp8_wgmma_without_spills(BM, dual):
    """Each W4A8 tile on sm_90: its MMAs are FP8 warpgroup MMAs (E4M3 x E4M3 into fp32, the decoded weights as the
    register operand), and nothing spills to local memory."""
    pytest.importorskip("triton", reason="triton is not installed")
    for p in (ROOT / "src", ROOT / "kernels"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    try:
        sass, res = _compile_sm90(BM, dual)
    except (AttributeError, FileNotFoundError, RuntimeError) as ex:  # no CUDA backend tools in this install
        pytest.skip(f"cannot compile for sm_90 here: {ex!r}")
    mmas = re.findall(r"(QGMMA\.[0-9x]+\.F32\.E4M3\.E4M3) R\d+, R\d+, gdesc", sass)
    assert mmas and len(mmas) == len(re.findall(r"[QH]GMMA|HMMA", sass)), sass[:2000]
    assert int(re.search(r"STACK:(\d+)", res).group(1)) == 0, res


if __name__ == "__main__":
    _worker()
