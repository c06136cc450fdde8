"""kimi3_kernels.kda: Triton kernels (run by the Triton interpreter on CPU) against the PyTorch
references and an independent fp64 step-by-step recurrence written here.

Tolerances (relative, ||x - ref|| / ||ref||):
  fp32 inputs: 1e-4 (seen ~1e-6), gradients 2e-4;  bf16 inputs: 2e-2 (seen ~4e-3).
The interpreter must be on before the kernel modules define their kernels, and it must not leak into
other tests (the model would run its kernels interpreted): tests/test_kernels_kda.py runs this module in
its own pytest process with TRITON_INTERPRET=1.
"""
import importlib
import math
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import kimi3_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, os.path.join(ROOT, "kernels"))

from kimi3_kernels import kda  # noqa: E402
from kimi3_kernels.kda import (chunk_kda, fused_recurrent_kda, naive_chunk_kda, naive_recurrent_kda,  # noqa: E402
                               state_kv_to_vk, state_vk_to_kv)

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GTOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2}


def _ensure_interpreter():
    if not kda.TRITON_AVAILABLE:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    from kimi3_kernels.kda import chunk_bwd, chunk_fwd, gate, recurrent
    if not isinstance(chunk_fwd._intra_fwd_kernel, InterpretedFunction):
        from kimi3_kernels import moe_decode
        from kimi3_kernels.kda import layer_ops
        for m in (gate, chunk_fwd, chunk_bwd, recurrent, layer_ops, moe_decode):
            importlib.reload(m)
    return isinstance(chunk_fwd._intra_fwd_kernel, InterpretedFunction)


needs_triton = pytest.mark.skipif(not _ensure_interpreter(), reason="triton (interpreter) not available")


def default_launch_in_ci(cases, at):
    """Parametrize cases: those with a non-default launch setting (`case[at]` not "") are `slow`, run by `make
    test-all`: the launch variants' tiles are checked on the GPU (bench/kda.py, pytest -m gpu), and under the
    interpreter each costs as much as the default case."""
    return [pytest.param(*c, marks=pytest.mark.slow) if c[at] else c for c in cases]


# ------------------------------------------------------------------ independent fp64 recurrence
def rec64(q, k, v, f, beta, A_log, dt_bias, lb=None, scale=None, h0=None, cu=None, l2=True):
    """S <- Diag(exp g) S; S <- S + b k (v - S^T k)^T; o = S^T (scale q), everything in float64."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    d = torch.float64
    q, k, v, f, beta = (x.to(d) for x in (q, k, v, f, beta))
    x = f + dt_bias.to(d).view(H, K)
    a = torch.exp(A_log.to(d)[:H]).view(H, 1)
    g = lb * torch.sigmoid(a * x) if lb is not None else -a * torch.log1p(torch.exp(x))
    if l2:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (K ** -0.5 if scale is None else scale)
    b = torch.sigmoid(beta)
    seqs = [(i, 0, T) for i in range(B)] if cu is None else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    outs = [[None] * T for _ in range(B)]
    finals = []
    for n, (bb, s, e) in enumerate(seqs):
        S = torch.zeros(H, K, V, dtype=d) if h0 is None else h0[n].to(d)
        for t in range(s, e):
            S = S * torch.exp(g[bb, t])[..., None]
            u = b[bb, t][:, None] * (v[bb, t] - torch.einsum("hk,hkv->hv", k[bb, t], S))
            S = S + k[bb, t][..., None] * u[:, None, :]
            outs[bb][t] = torch.einsum("hk,hkv->hv", q[bb, t], S)
        finals.append(S)
    zero = torch.zeros(H, V, dtype=d)
    o = torch.stack([torch.stack([x if x is not None else zero for x in row]) for row in outs])
    return o, torch.stack(finals)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bf16_ulps(a, b):
    """Largest |a - b| in units of b's bf16 spacing (2^(e - 7) for |b| in [2^e, 2^(e+1)))."""
    a, b = a.double(), b.double()
    spacing = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0 ** -126))) - 7)
    return ((a - b).abs() / spacing).max().item()


def make(B, T, H, K, V, dtype=torch.float32, seed=0, A_shift=0.0, N=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v, f, beta = (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K), r(B, T, H))
    q, k, v, f, beta = (x.to(dtype) for x in (q, k, v, f, beta))
    A_log = r(H) * 0.5 + A_shift
    dt_bias = r(H * K) * 0.3
    h0 = r(B if N is None else N, H, K, V)
    return q, k, v, f, beta, A_log, dt_bias, h0


# ------------------------------------------------------------------ references (no Triton)
@pytest.mark.parametrize("lb", [None, -5.0])
def test_references_vs_fp64(lb):
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 150, 2, 16, 32, N=4)
    cu = torch.tensor([0, 0, 1, 70, 150])
    ro, rs = rec64(q, k, v, f, beta, A_log, dtb, lb, h0=h0, cu=cu)
    for fn in (naive_recurrent_kda, naive_chunk_kda):
        o, s = fn(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                  output_final_state=True, cu_seqlens=cu)
        assert rel(o, ro) < 1e-5 and rel(s, rs) < 1e-5, fn.__name__


def test_references_vs_fla_naive():
    try:
        from fla.ops.kda.naive import naive_chunk_kda as fla_chunk, naive_recurrent_kda as fla_rec
    except Exception:  # noqa: BLE001
        pytest.skip("fla not installed")
    from kimi3_kernels.kda import kda_gate, l2norm
    q, k, v, f, beta, A_log, dtb, h0 = make(2, 128, 2, 16, 32)
    for lb in (None, -5.0):
        o, s = naive_chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                               output_final_state=True)
        args = (l2norm(q), l2norm(k), v, kda_gate(f, A_log, dtb, lb), torch.sigmoid(beta))
        for fn in (fla_chunk, fla_rec):
            fo, fs = fn(*args, initial_state=h0, output_final_state=True)
            assert rel(o, fo) < 1e-5 and rel(s, fs) < 1e-5


def test_state_layout_helpers():
    s = torch.randn(3, 2, 16, 32)
    vk = state_kv_to_vk(s)
    assert vk.shape == (3, 2, 32, 16) and torch.equal(state_vk_to_kv(vk), s)


def test_chunk_tables_are_reused():
    # Building the chunk tables waits for the stream: fixed-length batches' are built once per shape, a varlen
    # batch's once per cu_seqlens tensor while it is unchanged (in place changes and inference tensors, which keep no
    # version counter, rebuild them)
    from kimi3_kernels.kda._utils import SeqInfo
    a = SeqInfo.get(2, 130, None, "cpu")
    assert a is SeqInfo.get(2, 130, None, "cpu") and a is not SeqInfo.get(2, 131, None, "cpu")
    assert a.NC == 6 and a.chunk_tab.tolist() == [[0, 0], [0, 64], [0, 128], [1, 130], [1, 194], [1, 258]]
    assert a.cu.tolist() == [0, 130, 260] and a.chunk_off.tolist() == [0, 3, 6]
    cu = torch.tensor([0, 70, 130])
    c = SeqInfo.get(1, 130, cu, "cpu")
    assert c is SeqInfo.get(1, 130, cu, "cpu") and c is not SeqInfo.get(1, 131, cu, "cpu")
    c = SeqInfo.get(1, 130, cu, "cpu")
    assert c.NC == 3 and c.cu.tolist() == [0, 70, 130] and c.chunk_off.tolist() == [0, 2, 3]
    assert c.chunk_tab.tolist() == [[0, 0], [0, 64], [1, 70]]
    cu[1] = 3
    d = SeqInfo.get(1, 130, cu, "cpu")
    assert d is not c and d.chunk_off.tolist() == [0, 1, 3] and d.tokens == 130
    assert d.chunk_tab.tolist() == [[0, 0], [1, 3], [1, 67]]  # lengths 3 and 127
    assert SeqInfo.get(1, 130, cu.clone(), "cpu") is not d  # another tensor with the same values: rebuilt
    with torch.inference_mode():
        ci = torch.tensor([0, 70, 130])
    assert SeqInfo.get(1, 130, ci, "cpu") is not SeqInfo.get(1, 130, ci, "cpu")
    # each table starts on a 16-byte boundary of the one buffer they share
    e = SeqInfo.get(1, 130, torch.tensor([0, 1, 2, 3, 130]), "cpu")
    assert all(t.data_ptr() % 16 == 0 for t in (e.cu, e.chunk_off, e.chunk_tab))


def launches(spec):
    """launch_overrides for 'name=tile:warps:stages[:maxnreg],...' (an empty field keeps the table's value)."""
    from kimi3_kernels.kda.configs import LAUNCH, launch_overrides
    table = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, vals = item.partition("=")
        base = list(LAUNCH[name]) + [None] * (4 - len(LAUNCH[name]))
        new = [int(f) if f.strip() else b for f, b in zip(vals.split(":") + [""] * 4, base)]
        table[name] = tuple(new[:4]) if new[3] is not None else tuple(new[:3])
    return launch_overrides(table)


def test_launch_config():
    from kimi3_kernels.kda.configs import LAUNCH, launch_config, launch_overrides
    with launches("intra_fwd=64:2:, state_fwd=:4:3, wu_fwd=:::128"):
        assert launch_config("intra_fwd") == (64, 2, LAUNCH["intra_fwd"][2], {})
        assert launch_config("state_fwd") == (LAUNCH["state_fwd"][0], 4, 3, {})
        assert launch_config("wu_fwd") == (*LAUNCH["wu_fwd"], {"maxnreg": 128})
        assert launch_config("diag_fwd") == (*LAUNCH["diag_fwd"], {})
    assert launch_config("intra_fwd") == (*LAUNCH["intra_fwd"], {})  # restored on exit
    assert launch_config("sub_fwd") == (32, 1, 1, {"maxnreg": 160})  # a default cap, lifted by 0
    with launches("sub_fwd=:::0"):
        assert launch_config("sub_fwd") == (32, 1, 1, {})
    with pytest.raises(ValueError, match="intra"):
        with launch_overrides({"intra": (64, 2, 1)}):
            pass
    # the forward scan's value tile and stages: 32 wide on 3 stages when 64-wide tiles leave SMs idle (H=32 at B=1)
    from kimi3_kernels.kda.configs import state_scan_tile
    cpu = torch.device("cpu")
    assert [state_scan_tile(n, cpu) for n in (1, 64, 131, 132, 192)] == [(32, 3)] * 3 + [(64, 2)] * 2


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.path.insert(0, %r)\n"
            "import kimi3_kernels, torch\n"
            "from kimi3_kernels.kda import chunk_kda, TRITON_AVAILABLE\n"
            "assert not TRITON_AVAILABLE and not kimi3_kernels.TRITON_AVAILABLE\n"
            "x = torch.zeros(1, 2, 1, 16)\n"
            "try:\n"
            "    chunk_kda(x, x, x, x, x[..., 0], A_log=torch.zeros(1), dt_bias=torch.zeros(16))\n"
            "except RuntimeError as e:\n"
            "    assert 'Triton' in str(e); print('ok')\n") % os.path.join(ROOT, "kernels")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# ------------------------------------------------------------------ Triton kernels (interpreter)
@needs_triton
@pytest.mark.parametrize("lb,dtype", [(-5.0, torch.float32), (None, torch.float32), (-5.0, torch.bfloat16)])
def test_chunk_forward(lb, dtype):
    # T = 80: one full and one partial chunk; K != V
    q, k, v, f, beta, A_log, dtb, h0 = make(2, 80, 2, 16, 32, dtype)
    o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                     output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32 and s.shape == (2, 2, 16, 32)
    ro, rs = rec64(q, k, v, f, beta, A_log, dtb, lb, h0=h0)
    assert rel(o, ro) < TOL[dtype] and rel(s, rs) < TOL[dtype]
    po, ps = naive_chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                             output_final_state=True)
    assert rel(o, po) < TOL[dtype] and rel(s, ps) < TOL[dtype]


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty's float tensors start as NaN, so a result that leans on memory no kernel wrote shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                          else t)(empty(*a, **kw)))


# slow (make test-all): bf16 twin of test_chunk_varlen, which runs in CI
@pytest.mark.slow
@needs_triton
def test_chunk_forward_varlen_bf16(nan_empty):
    # the output kernel reads the chunk entry states kept in the matmul dtype: varlen with an empty and a
    # one-token sequence, bf16. Every uninitialised float buffer starts as NaN here, so a result that leans on
    # memory no kernel wrote (the rows after the last sequence, say) shows.
    q, k, v, f, beta, A_log, dtb, _ = make(1, 150, 2, 32, 32, torch.bfloat16, seed=11)
    cu = torch.tensor([0, 0, 1, 70, 150], dtype=torch.int32)
    o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, cu_seqlens=cu,
                     output_final_state=True)
    ro, rs = rec64(q, k, v, f, beta, A_log, dtb, -5.0, cu=cu)
    assert rel(o, ro) < TOL[torch.bfloat16] and rel(s, rs) < TOL[torch.bfloat16]
    # tokens after the last sequence: zero outputs
    cu = torch.tensor([0, 0, 1, 70, 120], dtype=torch.int32)
    o, _ = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, cu_seqlens=cu)
    ro, _ = rec64(q, k, v, f, beta, A_log, dtb, -5.0, cu=cu)
    assert rel(o[:, :120], ro[:, :120]) < TOL[torch.bfloat16] and o[:, 120:].eq(0).all()


@needs_triton
# under the interpreter only the tile widths change the arithmetic's shape (warps and stages are launch resources):
# one setting per distinct set of tile widths
@pytest.mark.parametrize("launch", [c[0] if not c[0] else pytest.param(c[0], marks=pytest.mark.slow) for c in (
    ("intra_fwd=16:4:1",), ("intra_fwd=64:8:1",),
    ("intra_fwd=64:1:1,diag_fwd=64:1:1,wu_fwd=32:2:1,state_fwd=64:4:1,output_fwd=32:2:3,prep_fwd=:1:,"
     "diag_fwd_loop=32:2:1,diag_inv=:2:",),
    ("prep_fwd=16::,norm_fwd=16:1:,diag_fwd_loop=128:4:1",), ("prep_fwd=512:8:,norm_fwd=128:8:,wu_fwd=:::128",),
    ("",))])
def test_chunk_forward_launch_options(launch):
    # the training forward's kernels (64-token chunks, taken with autograd) under other tile widths, warps and stages
    # (prep_fwd's tile: the gate's column block; bench/kda.py sweeps them on the GPU): same results, both gates, with a
    # partial last chunk
    with launches(launch), torch.enable_grad():
        for lb in (-5.0, None):
            q, k, v, f, beta, A_log, dtb, h0 = make(1, 100, 2, 64, 32, seed=12)
            o, s = chunk_kda(q.requires_grad_(), k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb,
                             initial_state=h0[:1], output_final_state=True)
            ro, rs = rec64(q.detach(), k, v, f, beta, A_log, dtb, lb, h0=h0[:1])
            assert rel(o.detach(), ro) < TOL[torch.float32] and rel(s.detach(), rs) < TOL[torch.float32]


@needs_triton
def test_chunk_forward_options():
    # K = V = 32, T = 1, no initial state, no l2norm, explicit scale, strong decay (per-column diagonal path)
    q, k, v, f, beta, A_log, dtb, _ = make(1, 1, 1, 32, 32)
    o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, output_final_state=True)
    ro, rs = rec64(q, k, v, f, beta, A_log, dtb)
    assert rel(o, ro) < 1e-4 and rel(s, rs) < 1e-4
    q, k, v, f, beta, A_log, dtb, _ = make(1, 70, 1, 32, 32, A_shift=3.0, seed=3)
    o, s = chunk_kda(q * 0.3, k * 0.3, v, f, beta, A_log=A_log, dt_bias=dtb, scale=0.5, output_final_state=True,
                     use_qk_l2norm_in_kernel=False)
    ro, rs = rec64(q * 0.3, k * 0.3, v, f, beta, A_log, dtb, scale=0.5, l2=False)
    assert torch.isfinite(o).all() and rel(o, ro) < 1e-4 and rel(s, rs) < 1e-4


@needs_triton
@pytest.mark.parametrize("lb", [-5.0, None])
def test_chunk_varlen(lb):
    cu = torch.tensor([0, 0, 1, 66, 66, 80], dtype=torch.int32)  # empty, length-1, 65, empty, 14
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 80, 2, 16, 16, N=5, seed=1)
    o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                     output_final_state=True, cu_seqlens=cu)
    ro, rs = rec64(q, k, v, f, beta, A_log, dtb, lb, h0=h0, cu=cu)
    assert rel(o, ro) < 1e-4 and rel(s, rs) < 1e-4
    assert torch.equal(s[0], h0[0]) and torch.equal(s[3], h0[3])  # empty sequences keep their state
    _, _, cs = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                         cu_seqlens=cu, return_chunk_states=True)
    _, _, rcs = naive_chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                                cu_seqlens=cu, return_chunk_states=True)
    assert cs.shape == (4, 2, 16, 16) and rel(cs, rcs) < 1e-4


@needs_triton
@pytest.mark.parametrize("lb,K,V,T,A_shift,launch", default_launch_in_ci([
    (-5.0, 64, 32, 100, 0.0, ""), (None, 32, 32, 130, 0.0, ""),
    # unbounded and steep: sub-chunks on both sides of the per-column loop's threshold
    (None, 16, 16, 100, 3.0, "sub_fwd=16:2:1,rec_fwd=16:2:1"), (-5.0, 48, 32, 70, 3.0, "rec_fwd=64:4:3,sub_fwd=:::0"),
    (-5.0, 32, 64, 1, 0.0, "sub_fwd=64:4:1,rec_fwd=32:2:1")], at=5))
def test_chunk_forward_sub16(lb, K, V, T, A_shift, launch, monkeypatch):
    """The inference forward in 16-token sub-chunks (the diagonal tiles, their inverses and the recurrence with the
    output, no 64-token pairwise stage) against the fp64 recurrence and the training forward's 64-token kernels:
    output, final state and the states at 64-token boundaries."""
    from kimi3_kernels.kda import chunk_fwd
    calls = []
    sub = chunk_fwd.sub16_fwd
    monkeypatch.setattr(chunk_fwd, "sub16_fwd", lambda *a, **kw: calls.append(1) or sub(*a, **kw))
    q, k, v, f, beta, A_log, dtb, h0 = make(1, T, 2, K, V, seed=23, A_shift=A_shift)
    kw = dict(A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0[:1], output_final_state=True,
              return_chunk_states=True)
    out = {}
    with launches(launch):
        out["1"] = chunk_kda(q, k, v, f, beta, **kw)
        with torch.enable_grad():  # autograd: the 64-token kernels, which the backward reads
            out["0"] = [x.detach() for x in chunk_kda(q.clone().requires_grad_(), k, v, f, beta, **kw)]
    assert len(calls) == 1
    ro, rs = rec64(q, k, v, f, beta, A_log, dtb, lb, h0=h0[:1])
    o, s, cs = out["1"]
    assert torch.isfinite(o).all() and rel(o, ro) < TOL[torch.float32] and rel(s, rs) < TOL[torch.float32]
    assert all(rel(a, b) < 2e-5 for a, b in zip(out["1"], out["0"]))  # the same math, another chunking
    assert cs.shape == out["0"][2].shape and torch.equal(cs[0], h0[0])


@needs_triton
def test_chunk_sub16_varlen():
    cu = torch.tensor([0, 0, 1, 66, 66, 97], dtype=torch.int32)  # empty, length-1, 65, empty, 31
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 100, 2, 16, 16, N=5, seed=24)
    for lb in (-5.0, None):
        o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                         output_final_state=True, cu_seqlens=cu)
        ro, rs = rec64(q, k, v, f, beta, A_log, dtb, lb, h0=h0, cu=cu)
        assert rel(o[:, :97], ro[:, :97]) < 1e-4 and rel(s, rs) < 1e-4
        assert torch.equal(s[0], h0[0]) and torch.equal(s[3], h0[3])
        assert torch.equal(o[:, 97:], torch.zeros_like(o[:, 97:]))  # tokens after the last sequence
    _, _, cs = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, initial_state=h0,
                         cu_seqlens=cu, return_chunk_states=True)
    _, _, rcs = naive_chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, initial_state=h0,
                                cu_seqlens=cu, return_chunk_states=True)
    assert cs.shape == (4, 2, 16, 16) and rel(cs, rcs) < 1e-4


# slow (make test-all): segmented sub-chunk launches, the same kernels test_chunk_forward_sub16 covers in one segment
@pytest.mark.slow
@needs_triton
def test_chunk_sub16_segments(monkeypatch):
    """The 16-token forward in segments of the chunks, the state carried between the recurrence's launches:
    bit-identical to one segment (the same steps, the state through memory in fp32), sequences spanning segment
    boundaries, empty ones between them, and the fp64 recurrence."""
    from kimi3_kernels.kda import chunk_fwd
    cpu = torch.device("cpu")  # an H200's 132 SMs stand in
    # one segment per 64 chunks (at most 16) where the recurrence has at most one program per SM
    auto = chunk_fwd.fwd16_segments
    assert auto(7, 128, cpu) == [(0, 7)] and auto(127, 128, cpu) == [(0, 127)] and auto(0, 128, cpu) == [(0, 0)]
    assert auto(256, 132, cpu) == [(0, 64), (64, 128), (128, 192), (192, 256)] and auto(256, 133, cpu) == [(0, 256)]
    assert len(auto(1024, 128, cpu)) == 16 and len(auto(4096, 128, cpu)) == 16 and auto(4096, 128, cpu)[1][0] == 256
    # chunks: 1 (length 1), 3 (149 tokens: chunks 1-3, across the first boundary), 3 (150: chunks 4-6, across the
    # second); the empty sequences sit at chunks 1 and 4
    cu = torch.tensor([0, 0, 1, 150, 150, 300], dtype=torch.int32)
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 300, 2, 16, 16, N=5, seed=25)
    kw = dict(A_log=A_log, dt_bias=dtb, initial_state=h0, output_final_state=True, cu_seqlens=cu,
              return_chunk_states=True)
    thirds = lambda n, programs, device: [(lo, min(lo + 3, n)) for lo in range(0, n, 3)] or [(0, 0)]  # noqa: E731
    for lb in (-5.0, None):
        one = chunk_kda(q, k, v, f, beta, lower_bound=lb, **kw)
        with monkeypatch.context() as m:
            m.setattr(chunk_fwd, "fwd16_segments", thirds)
            three = chunk_kda(q, k, v, f, beta, lower_bound=lb, **kw)
        assert all(torch.equal(a, b) for a, b in zip(one, three))
        ro, rs = rec64(q, k, v, f, beta, A_log, dtb, lb, h0=h0, cu=cu)
        o, s, _ = three
        assert rel(o, ro) < 1e-4 and rel(s, rs) < 1e-4
        assert torch.equal(s[0], h0[0]) and torch.equal(s[3], h0[3])


def check_vs_fp64(ins, lb, do, dS=None):
    """chunk_kda's output, final state and the gradients of every input (q, k, v, g, beta, A_log, dt_bias, h0: fp32)
    against the fp64 recurrence, for the loss <o, do> + <state, dS> (dS: ones)."""
    res = {}
    for name in ("triton", "fp64"):
        xs = [x.double().clone().requires_grad_() if name == "fp64" else x.clone().requires_grad_() for x in ins]
        if name == "triton":
            o, s = chunk_kda(*xs[:5], A_log=xs[5], dt_bias=xs[6], lower_bound=lb, initial_state=xs[7],
                             output_final_state=True)
        else:
            o, s = rec64(*xs[:5], xs[5], xs[6], lb, h0=xs[7])
        w = torch.ones_like(s) if dS is None else dS.to(s.dtype)
        ((o * do.to(o.dtype)).sum() + (s * w).sum()).backward()
        res[name] = [o, s] + [x.grad for x in xs]
    names = ["o", "state", "q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"]
    for i, (n, a, b) in enumerate(zip(names, res["triton"], res["fp64"])):
        assert rel(a, b) < (TOL if i < 2 else GTOL)[torch.float32], (n, rel(a, b))


@needs_triton
@pytest.mark.parametrize("lb,launch,ksplit,K,V", default_launch_in_ci([
    (-5.0, "", 2, 16, 32), (None, "", 2, 16, 32), (None, "intra_fwd=16:4:1", 2, 16, 32), (None, "", 1, 64, 32),
    (None, "", 2, 64, 32), (-5.0, "", 4, 64, 32),
    (-5.0, "main_bwd=16:4:2,intra_bwd=16:2:2,state_bwd=16:4:1,prep_bwd=:2:1", 2, 64, 32),
    (None, "intra_bwd_loop=16:2:2", 2, 16, 32),
    # the backward scan's 64-wide value tiles (taken on large grids)
    (-5.0, "state_bwd=64:8:2", 2, 16, 64),
    # the gate's backward in column slices apart from the norms' (two slices of 32 for a 48-wide head: the second
    # one half masked)
    (-5.0, "prep_bwd=32::", 2, 48, 32), (None, "prep_bwd_softplus=16:2:1", 2, 64, 32)], at=1))
def test_chunk_gradients(lb, launch, ksplit, K, V, monkeypatch):
    # the backward reuses the per-chunk quantities the forward kept; the main backward kernel's K columns in 1, 2
    # (the default) or 4 slices; other launch settings
    from kimi3_kernels.kda import chunk_bwd, chunk_fwd
    monkeypatch.setattr(chunk_bwd, "MAIN_BWD_KSPLIT", ksplit)
    intra_calls = []
    intra = chunk_fwd.intra_fwd
    monkeypatch.setattr(chunk_fwd, "intra_fwd", lambda *a, **kw: intra_calls.append(1) or intra(*a, **kw))
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 80, 2, K, V, seed=2)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, 80, 2, V, generator=gen)
    dS = torch.randn(1, 2, K, V, generator=gen)
    with launches(launch):
        check_vs_fp64([q, k, v, f, beta, A_log, dtb, h0], lb, do, dS)
    assert len(intra_calls) == 1  # the forward's; the backward recomputes nothing


@needs_triton
def test_chunk_gradients_twice_through_a_retained_graph():
    # a second backward through a retained graph recomputes the per-chunk quantities the first one released
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 80, 2, 16, 32, seed=6)
    with torch.enable_grad():
        qq = q.clone().requires_grad_()
        o, _ = chunk_kda(qq, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0)
        (g1,) = torch.autograd.grad(o.square().sum(), qq, retain_graph=True)
        (g2,) = torch.autograd.grad(o.square().sum(), qq)
    assert rel(g2, g1) < 1e-5 and g1.abs().max() > 0


@needs_triton
def test_intra_backward_diagonal_tiles_take_3xtf32(monkeypatch):
    """One-pass TF32 in the intra backward's diagonal tiles leaves errors that the gate parameters' gradients sum over
    every token (bf16, K3 gate, T=8192: ddt_bias 4.2e-2 from the fp32 reference, 4.1e-3 with 3xTF32 there). The
    interpreter's dot is fp32 whatever the precision, so this checks what the kernel is launched with: bf16 inputs one
    pass off the diagonal and 3xTF32 on it, fp32 inputs 3xTF32 everywhere."""
    from kimi3_kernels.kda import chunk_bwd, chunk_fwd

    class Recorder:
        def __init__(self, fn):
            self.fn, self.calls = fn, []

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.calls.append((kwargs["PREC"], kwargs["DPREC"]))
                return self.fn[grid](*args, **kwargs)
            return launch

    q, k, v, f, beta, A_log, dtb, _ = make(1, 40, 1, 16, 16, seed=3)

    def launched(dtype):
        rec = Recorder(chunk_bwd._intra_bwd_kernel)
        monkeypatch.setattr(chunk_bwd, "_intra_bwd_kernel", rec)
        # the interpreter keeps every intermediate in fp32, so bf16's choice is made here as a GPU makes it
        monkeypatch.setattr(chunk_bwd, "_prec", lambda _: chunk_fwd._prec(dtype))
        xs = [x.clone().requires_grad_() for x in (q, k, v, f)]
        o, _ = chunk_kda(*xs, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0)
        o.sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in xs)
        return rec.calls

    assert chunk_fwd._prec(torch.bfloat16) == "tf32"
    assert launched(torch.bfloat16) == [("tf32", "tf32x3")]
    assert launched(torch.float32) == [("tf32x3", "tf32x3")]


@needs_triton
@pytest.mark.parametrize("lb", [-5.0, None])
def test_head_dims_not_a_power_of_two(lb):
    # K = 96, V = 48: the kernels' tiles are wider than the head, so every store must mask its spare columns (an
    # unmasked one wrote into the next row and past the buffer: a crash under the interpreter, corruption on a GPU).
    # Forward, state and gradients against fp64, with an initial state and a partial last chunk.
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 80, 1, 96, 48, seed=23)
    do = torch.randn(1, 80, 1, 48, generator=torch.Generator().manual_seed(24))
    check_vs_fp64([q, k, v, f, beta, A_log, dtb, h0[:1]], lb, do)


@needs_triton
def test_unbounded_gate_dense_and_loop_diagonal_tiles():
    # Unbounded (softplus) gate: each diagonal tile (per K slice) takes one matmul when its gate span is at most
    # chunk_fwd.DENSE_MAX_SPAN and the per-column loop otherwise. Heads with steep, moderate and mild decay put tiles
    # on both sides of the threshold, in the same launch and within one head; forward and gradients against fp64.
    # The backward runs the chunks the forward marked steep apart.
    from kimi3_kernels.kda.chunk_fwd import DENSE_MAX_SPAN
    q, k, v, f, beta, _, dtb, h0 = make(1, 80, 3, 16, 16, seed=21)
    A_log = torch.tensor([3.0, 0.0, 1.6])
    g = -torch.exp(A_log).view(3, 1) * torch.nn.functional.softplus(f[0] + dtb.view(3, 16))  # [T, H, K], nats
    span = -g[:64].view(4, 16, 3, 16)[:, 1:].sum(1) / math.log(2)  # per 16-row tile of the full chunk, log2 units
    assert (span.amax(-1)[:, 0] > DENSE_MAX_SPAN).all() and (span.amax(-1)[:, 1] < DENSE_MAX_SPAN).all()
    assert (span[..., 2] > DENSE_MAX_SPAN).any() and (span[..., 2] < DENSE_MAX_SPAN).any()
    do = torch.randn(1, 80, 3, 16, generator=torch.Generator().manual_seed(22))
    check_vs_fp64([q, k, v, f, beta, A_log, dtb, h0[:1]], None, do)


@needs_triton
def test_chunk_gradients_from_unfilled_buffers(nan_empty):
    # The backward allocates its gradient buffers without a zero fill: every uninitialised float buffer starts as NaN
    # here, so a gradient that leans on memory no kernel wrote shows. Varlen with an empty sequence, a one-token one,
    # a partial last chunk and tokens after the last sequence (zero gradients); both gates, fp32, against the PyTorch
    # reference's autograd.
    cu = torch.tensor([0, 0, 1, 70, 130], dtype=torch.int32)
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 150, 2, 16, 16, N=4, seed=41)
    do = torch.randn(1, 150, 2, 16, generator=torch.Generator().manual_seed(42))
    for lb in (-5.0, None):
        grads = []
        for fn in (chunk_kda, naive_chunk_kda):
            xs = [x.detach().clone().requires_grad_() for x in (q, k, v, f, beta, A_log, dtb, h0)]
            o, s = fn(*xs[:5], A_log=xs[5], dt_bias=xs[6], lower_bound=lb, initial_state=xs[7],
                      output_final_state=True, cu_seqlens=cu)
            ((o * do)[:, :130].sum() + s.sum()).backward()
            grads.append([x.grad for x in xs])
        for name, a, b in zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"), *grads):
            assert torch.isfinite(a).all() and rel(a, b) < GTOL[torch.float32], (lb, name, rel(a, b))
        for a in grads[0][:5]:
            assert a[:, 130:].eq(0).all()


@needs_triton
def test_chunk_gradients_varlen_bf16():
    cu = torch.tensor([0, 1, 1, 70], dtype=torch.int32)
    q, k, v, f, beta, A_log, dtb, h0 = make(1, 70, 1, 16, 16, torch.bfloat16, N=3, seed=4)
    ins = [q, k, v, f, beta, A_log, dtb, h0]
    res = []
    for fn, cast in ((chunk_kda, False), (naive_chunk_kda, True)):
        xs = [(x.float() if cast else x).detach().clone().requires_grad_() for x in ins]
        o, s = fn(*xs[:5], A_log=xs[5], dt_bias=xs[6], lower_bound=-5.0, initial_state=xs[7],
                  output_final_state=True, cu_seqlens=cu)
        (o.float().pow(2).sum() + s.sum()).backward()
        res.append([x.grad for x in xs])
    for a, b in zip(*res):
        assert rel(a.float(), b) < GTOL[torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("T", [1, 3])
def test_fused_recurrent(T):
    q, k, v, f, beta, A_log, dtb, h0 = make(2, T, 2, 16, 32, seed=6)
    st = h0.clone()
    o, s = fused_recurrent_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, initial_state=st,
                               inplace_final_state=True)
    ro, rs = rec64(q, k, v, f, beta, A_log, dtb, -5.0, h0=h0)
    assert s is st and rel(o, ro) < 1e-5 and rel(st, rs) < 1e-5
    # varlen with an empty sequence, softplus gate, bf16 inputs
    cu = torch.tensor([0, 0, T, 2 * T])
    qb, kb, vb, fb, bb = (x.reshape(1, 2 * T, *x.shape[2:]).bfloat16() for x in (q, k, v, f, beta))
    h3 = torch.cat([h0, h0[:1]])
    o, s = fused_recurrent_kda(qb, kb, vb, fb, bb, A_log=A_log, dt_bias=dtb, initial_state=h3,
                               output_final_state=True, cu_seqlens=cu)
    ro, rs = rec64(qb, kb, vb, fb, bb, A_log, dtb, h0=h3, cu=cu)
    assert o.dtype == torch.bfloat16 and rel(o, ro) < TOL[torch.bfloat16] and rel(s, rs) < 1e-4


@needs_triton
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fused_recurrent_skips_positions_whose_gate_and_beta_are_minus_inf(lower_bound):
    # how Kimi3Cache.keep_rows keeps a different prefix per row in one launch: a position with raw gate and beta at
    # -inf decays by exp(0) = 1 and updates by 0, for both gates, in place
    q, k, v, f, beta, A_log, dtb, h0 = make(2, 5, 2, 16, 16, seed=7)
    keep = torch.arange(5)[None, :] < torch.tensor([2, 5])[:, None]
    st = h0.clone()
    fused_recurrent_kda(k, k, v, f.masked_fill(~keep[..., None, None], float("-inf")),
                        beta.masked_fill(~keep[..., None], float("-inf")), A_log=A_log, dt_bias=dtb,
                        lower_bound=lower_bound, initial_state=st, inplace_final_state=True)
    for row, n in ((0, 2), (1, 5)):
        _, rs = rec64(*(x[row:row + 1, :n] for x in (k, k, v, f, beta)), A_log, dtb, lower_bound,
                      h0=h0[row:row + 1])
        assert bool(torch.isfinite(st).all()) and rel(st[row:row + 1], rs) < 1e-5


# ------------------------------------------------------------------ decode-path fusions (layer_ops.py)
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,D,W", [(1, 1, 200, 4), (3, 3, 64, 4), (2, 2, 130, 3), (1, 4, 64, 4)])
def test_short_conv_update(B, T, D, W, dtype):
    from kimi3_kernels.kda.layer_ops import short_conv_update, short_conv_update_ref
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + W)
    xs = [torch.randn(B, T, D, generator=gen).to(dtype) for _ in range(3)]
    states = [torch.randn(B, D, W, generator=gen).to(dtype) for _ in range(3)]
    ws = [(0.5 * torch.randn(D, 1, W, generator=gen)).to(dtype) for _ in range(3)]
    ref_states = [st.clone() for st in states]
    ys = short_conv_update(xs, states, ws)
    refs = short_conv_update_ref(xs, ref_states, ws)
    for y, r, st, rst in zip(ys, refs, states, ref_states):
        assert y.dtype == dtype and torch.equal(st, rst)  # the state is the last W inputs, exactly
        # fp32: summation order only. bf16: the conv output is rounded to bf16 before the SiLU, as the reference
        # does; another summation order (and the interpreter's truncating casts) may move it by one ulp, the SiLU
        # carries that over (slope <= 1.1), the final cast adds one more, and near a power of two one ulp of y is
        # two of r: at most 3 of r's ulps (seen: 3)
        if dtype == torch.float32:
            assert ((y - r).abs() <= 1e-6 * (1 + r.abs())).all()
        else:
            assert bf16_ulps(y, r) <= 3


@needs_triton
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])  # the model keeps conv weights fp32
@pytest.mark.parametrize("B,T,D,W,with_state", [(1, 1, 200, 4, True), (2, 37, 72, 4, True), (1, 70, 130, 4, False),
                                                (2, 2, 64, 3, False), (1, 3, 64, 4, True)])
def test_short_conv(B, T, D, W, with_state, dtype, wdtype):
    """The prefill conv kernel against the model's PyTorch path (cat, conv1d, SiLU): T below, at and across the
    32-token tiles and below W, D across the 128-channel tiles, with and without a carried state."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from kimi3_kernels.kda.layer_ops import short_conv
    from transformers_kimi3.kda import causal_conv

    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + W)
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    state = torch.randn(B, D, W, generator=gen).to(dtype) if with_state else None
    w = (0.5 * torch.randn(D, 1, W, generator=gen)).to(wdtype)
    y, st = short_conv(x, w, state)
    r, rst = causal_conv(x, w, state)
    assert y.dtype == dtype and st.dtype == rst.dtype and torch.equal(st, rst)  # the last W inputs, exactly
    if dtype == torch.float32:
        assert ((y - r).abs() <= 1e-6 * (1 + r.abs())).all()
    elif wdtype == torch.float32:  # the model's case: one cast to bf16, which the interpreter truncates: <= 1 ulp
        assert bf16_ulps(y, r) <= 1
    else:  # bf16 weights also round the conv output before the SiLU; two truncating casts: seen 3.9 ulps from the
        # fp64 result, where PyTorch's path is 2.1 (a wrong tap or shift is off by whole units)
        exact, _ = causal_conv(x.double(), w.double(), None if state is None else state.double())
        assert bf16_ulps(y, exact) <= 4
    with pytest.raises(ValueError):
        short_conv(x, w[:-1], state)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(dtype):
    from kimi3_kernels.kda.layer_ops import gated_rms_norm, gated_rms_norm_ref
    gen = torch.Generator().manual_seed(3)
    x, g = (torch.randn(2, 3, 5, 32, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(32, generator=gen)
    y, r = gated_rms_norm(x, g, w, 1e-6), gated_rms_norm_ref(x, g, w, 1e-6)
    # bf16: both compute in fp32 and round once; the interpreter casts by truncation (the GPU rounds to nearest),
    # so the two may differ by one bf16 ulp, never more
    assert y.dtype == dtype and (rel(y, r) < 1e-6 if dtype == torch.float32 else bf16_ulps(y, r) <= 1)
    with pytest.raises(ValueError):
        gated_rms_norm(x, g[..., :16], w, 1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_gemv(dtype):
    from kimi3_kernels.moe_decode import expert_gemv, expert_gemv_ref
    gen = torch.Generator().manual_seed(8)
    T, D, I, E, k = 3, 72, 40, 6, 3
    x = torch.randn(T, D, generator=gen).to(dtype)
    w1, w3 = ((torch.randn(E, I, D, generator=gen) / 8).to(dtype) for _ in range(2))
    w2 = (torch.randn(E, D, I, generator=gen) / 6).to(dtype)
    idx = torch.tensor([[0, 5, 6], [2, 2, 1], [4, 3, 0]])  # 6: another rank's expert (skipped); 2 twice
    wts = torch.rand(T, k, generator=gen)
    y = expert_gemv(x, w1, w3, w2, idx, wts)
    exact = expert_gemv_ref(x.double(), w1.double(), w3.double(), w2.double(), idx, wts.double())
    # fp32: summation order; bf16: the roundings of the GEMM outputs (the interpreter truncates; seen 9e-3)
    assert y.dtype == torch.float32 and rel(y, exact) < (1e-5 if dtype == torch.float32 else 2e-2)
    if dtype == torch.float32:
        assert rel(y, expert_gemv_ref(x, w1, w3, w2, idx, wts)) < 1e-6
    with pytest.raises(ValueError):
        expert_gemv(x, w1, w3, w2.transpose(1, 2), idx, wts)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_gemv(dtype):
    from kimi3_kernels.moe_decode import mlp_gemv
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from transformers_kimi3.configuration_kimi3 import Kimi3TextConfig
    from transformers_kimi3.moe import Kimi3MLP

    gen = torch.Generator().manual_seed(5)
    D, I = 72, 40  # neither a multiple of the 8/16-row tiles nor of the 128-wide K steps
    mlp = Kimi3MLP(Kimi3TextConfig(hidden_size=D, hidden_act="silu"), I).to(dtype)
    for p in mlp.parameters():
        p.data = (torch.randn(p.shape, generator=gen) / 6).to(dtype)
    x = torch.randn(1, D, generator=gen).to(dtype)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    y = mlp_gemv(x, *weights)
    with torch.no_grad():
        ref = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x), mlp.up_proj(x)))  # the PyTorch path (no kernels on CPU)
        exact = mlp.double().down_proj(torch.nn.functional.silu(mlp.gate_proj(x.double())) * mlp.up_proj(x.double()))
    # fp32: summation order. bf16: three roundings to bf16 (gate/up outputs, GLU, down output); the interpreter
    # truncates them (the GPU rounds to nearest), which biases each by half an ulp: seen 1.1-1.4e-2 relative over
    # four seeds, where PyTorch's own bf16 path is 2-4e-3 from the fp64 result
    assert y.dtype == dtype and rel(y, ref) < (1e-6 if dtype == torch.float32 else 2e-2)
    assert rel(y, exact) < (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(ValueError):
        mlp_gemv(torch.cat([x, x]), *weights)  # one token only
    with pytest.raises(ValueError):
        mlp_gemv(x, weights[0], weights[1], weights[0])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_linears(dtype, M):
    """Up to six (input, weight) pairs in one launch against F.linear in fp64: weights of 1 to 130 rows (not
    multiples of the 32-row tiles), K = 200 (not a multiple of the 128-wide steps), inputs shared or not."""
    from kimi3_kernels.linears import MAX_ROWS, linears

    gen = torch.Generator().manual_seed(M)
    K = 200
    ws = [torch.randn(n, K, generator=gen).to(dtype) for n in (130, 1, 33, 64, 5, 32)]
    x = torch.randn(M, K, generator=gen).to(dtype)
    xs = [x, x, x] + [torch.randn(M, K, generator=gen).to(dtype) for _ in range(3)]
    for n in (1, 2, 6):
        ys = linears(xs[:n], ws[:n])
        assert len(ys) == n
        for y, xi, w in zip(ys, xs, ws):
            exact = torch.nn.functional.linear(xi.double(), w.double())
            assert y.dtype == dtype and y.shape == (M, w.shape[0]) and y.is_contiguous()
            if dtype == torch.float32:  # fp32 sums of fp32 products, another order
                assert rel(y, exact) < 1e-6
            else:  # one rounding of the fp32 sum (the interpreter truncates it: within an ulp)
                assert bf16_ulps(y, exact) <= 1.01
    with pytest.raises(ValueError, match="at most"):
        linears([torch.zeros(MAX_ROWS + 1, K, dtype=dtype)], ws[:1])
    with pytest.raises(ValueError, match="one shape"):
        linears([x, x[:, :-1]], ws[:2])
    y3 = linears([x.view(1, M, K)], ws[:1])[0]  # leading dims kept
    assert y3.shape == (1, M, ws[0].shape[0]) and torch.equal(y3[0], linears([x], ws[:1])[0])
    with pytest.raises(ValueError, match="one dtype"):
        linears([x], [ws[0].double()])
    with pytest.raises(ValueError, match="contiguous"):
        linears([x], [torch.randn(K, 8).to(dtype).t()])
    with pytest.raises(ValueError, match="pairs"):
        linears([x] * 7, ws + ws[:1])


def test_plain_weights_only_for_plain_linears(monkeypatch):
    """The decode's fused projections stand in only for plain nn.Linear calls: not for subclasses (quantised, LoRA),
    hooks, a replaced forward (Accelerate), a bias, another dtype, too many rows, or with the fused inference kernels off."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from transformers_kimi3 import kda as kda_layer

    x = torch.zeros(1, 1, 8)
    mods = [torch.nn.Linear(8, 4, bias=False) for _ in range(3)]
    assert [w is m.weight for w, m in zip(kda_layer._plain_weights(mods, x, 1), mods)] == [True] * 3
    assert kda_layer._plain_weights(mods, x, kda_layer.kernels.linear_ops.MAX_ROWS + 1) is None
    assert kda_layer._plain_weights(mods, x.double(), 1) is None

    class Sub(torch.nn.Linear):
        pass

    assert kda_layer._plain_weights(mods + [Sub(8, 4, bias=False)], x, 1) is None
    assert kda_layer._plain_weights(mods + [torch.nn.Linear(8, 4)], x, 1) is None
    hooked = torch.nn.Linear(8, 4, bias=False)
    handle = hooked.register_forward_hook(lambda *a: None)
    assert kda_layer._plain_weights(mods + [hooked], x, 1) is None
    handle.remove()
    assert kda_layer._plain_weights(mods + [hooked], x, 1) is not None
    hooked.forward = lambda t: t  # what accelerate's add_hook_to_module does
    assert kda_layer._plain_weights(mods + [hooked], x, 1) is None
    monkeypatch.setenv("KIMI3_INFERENCE_KERNELS", "0")
    assert kda_layer._plain_weights(mods, x, 1) is None


@needs_triton
def test_combine_sorted():
    """The grouped-GEMM (prefill) combine: expert-sorted bf16 rows, weighted per token in fp32, against the model's
    unsort + mask + weighted sum; a route to another rank's expert (index E) has a NaN row that must not leak."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from kimi3_kernels.moe_decode import combine_sorted
    from transformers_kimi3.moe import Kimi3Experts

    gen = torch.Generator().manual_seed(11)
    T, k, E, D = 9, 3, 5, 1100  # D across two 1024-wide tiles
    idx = torch.stack([torch.randperm(E + 1, generator=gen)[:k] for _ in range(T)])  # some routes to index E
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    offs = torch.bincount(flat, minlength=E + 1)[:E].cumsum(0)
    out = torch.randn(T * k, D, generator=gen).bfloat16()
    out[int(offs[-1]):] = float("nan")  # off-rank rows are never computed
    w = torch.rand(T, k, generator=gen)
    y = combine_sorted(out, order, idx, w, E)
    ref = (Kimi3Experts._unsort(out, order, offs).float().view(T, k, D) * w[..., None]).sum(1)
    assert (flat == E).any() and y.dtype == torch.float32 and not y.isnan().any()
    assert rel(y, ref) < 1e-6  # fp32 sums of the same products, another order
    with pytest.raises(ValueError):
        combine_sorted(out[:-1], order, idx, w, E)


@needs_triton
def test_model_padded_batch_through_the_kernels(monkeypatch):
    """A three-layer tiny model's left-padded batch with the Triton chunk kernels (forced onto the CPU interpreter)
    equals the PyTorch reference, and its KDA layers share one set of chunk tables: one packing plan per forward hands
    every layer the same cu_seqlens tensor."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from kimi3_testing import rel_err, tiny_model
    from transformers_kimi3 import kda as kda_layer

    from kimi3_kernels.kda import _utils
    # two KDA layers, enough to share the tables (each one runs every interpreted chunk kernel again: ~1 s a layer
    # here), and an MLA layer, which masks the padding instead of unpadding
    model = tiny_model(num_hidden_layers=3, linear_attn_config=dict(
        num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
        kda_layers=[1, 2], full_attn_layers=[3]))
    batch = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(batch)
    mask[1, :11] = 0
    with torch.no_grad():
        ref = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
        monkeypatch.setattr(kda_layer, "resolve_kda_backend", lambda device, requested=None, announce=True: "triton")
        built = []
        init = _utils.SeqInfo.__init__
        monkeypatch.setattr(_utils.SeqInfo, "__init__", lambda self, *a, **kw: built.append(1) or init(self, *a, **kw))
        got = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
    n_kda = sum(isinstance(m, kda_layer.Kimi3DeltaAttention) for m in model.modules())
    assert n_kda > 1 and len(built) == 1
    assert rel_err(got, ref) < 1e-4


@needs_triton
def test_grouped_experts_combine_in_the_module(monkeypatch):
    """Kimi3Experts' prefill path (bf16, torch._grouped_mm) with the combine kernel against the same GEMM outputs
    unsorted and summed in PyTorch, 40 tokens x top-3 (past the decode GEMV's route limit)."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from kimi3_testing import tiny_k3_text_config
    from transformers_kimi3 import kernels
    from transformers_kimi3 import moe as moe_mod

    monkeypatch.setattr(kernels, "kernel_device", lambda t: True)  # the kernels on CPU tensors, interpreted
    monkeypatch.setattr(moe_mod, "GEMV_MAX_ROUTES", 8)
    gen = torch.Generator().manual_seed(3)
    ex = moe_mod.Kimi3Experts(tiny_k3_text_config(hidden_act="silu", num_experts=6, moe_intermediate_size=32), 48)
    for p in ex.parameters():
        p.data = (torch.randn(p.shape, generator=gen) / 5).bfloat16()
    x = torch.randn(40, 48, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(40)])
    w = torch.rand(40, 3, generator=gen)
    calls = []
    real = kernels.moe_ops.combine_sorted
    monkeypatch.setattr(kernels.moe_ops, "combine_sorted", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        y = ex(x, idx, w)
        ref = (ex._unsort(*ex._grouped_mm(x, idx)).float().view(40, 3, -1) * w[..., None]).sum(1)
    assert calls == [1] and y.dtype == torch.float32
    assert rel(y, ref) < 1e-6  # the same bf16 rows weighted and summed in fp32, another order


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,with_partial", [(1, True), (3, False), (7, True), (8, True)])
def test_attn_res_mix(n, with_partial, dtype):
    """The one-launch AttnRes mix against the model's PyTorch path: 1 to 9 sources (8 + partial crosses a power of
    two), d across the 256-wide steps, a partial in fp32 (rounded to the bank's dtype first, as the model does)."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from kimi3_kernels.attn_res import attn_res_mix
    from transformers_kimi3 import attn_res as model_attn_res

    gen = torch.Generator().manual_seed(n)
    B, T, D = 2, 3, 300
    bank = (torch.randn(B, T, n, D, generator=gen) * torch.rand(1, 1, n, 1, generator=gen) * 3).to(dtype)
    partial = torch.randn(B, T, D, generator=gen) if with_partial else None
    proj, norm = model_attn_res.Kimi3AttnResProj(D), model_attn_res.Kimi3AttnResNorm(D, eps=1e-6)
    with torch.no_grad():
        proj.weight.normal_(0, 0.5, generator=gen)
        norm.weight.uniform_(0.5, 1.5, generator=gen)
        ref = model_attn_res.attn_res_mix(bank, partial, proj, norm)  # CPU: the PyTorch path
    for bd in (1024, 128):  # one step over d (the default width), and three
        y = attn_res_mix(bank, partial, norm.weight, proj.weight, norm.variance_epsilon, BD=bd, num_warps=4)
        assert y.dtype == dtype and y.shape == (B, T, D)
        # fp32: the same sums in another order; bf16: one rounding of the fp32 mix, truncated by the interpreter
        assert (rel(y, ref) < 1e-6) if dtype == torch.float32 else (bf16_ulps(y, ref) <= 1)
    with pytest.raises(ValueError):
        attn_res_mix(bank[:, :, :0], partial, norm.weight, proj.weight, 1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_mul_silu(dtype):
    from kimi3_kernels.moe_decode import glu_mul
    gen = torch.Generator().manual_seed(2)
    g, u = (3 * torch.randn(5, 37, generator=gen)).to(dtype), torch.randn(5, 37, generator=gen).to(dtype)
    ref = (torch.nn.functional.silu(g.float()) * u.float()).to(dtype)
    # bf16: the interpreter truncates the final cast (the GPU rounds), one bf16 ulp
    y = glu_mul(g, u)
    assert y.dtype == dtype and (rel(y, ref) < 1e-6 if dtype == torch.float32 else bf16_ulps(y, ref) <= 1)
    with pytest.raises(ValueError):
        glu_mul(g, u[:, :5])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear_beta", [None, 3.0])
def test_glu_mul_situ(dtype, linear_beta):
    """K3's SiTU-GLU in one launch against GLUActivation's PyTorch path, gate values well past the tanh bound."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from kimi3_kernels.moe_decode import glu_mul
    from transformers_kimi3.activations import GLUActivation

    act = GLUActivation("situ", 4.0, linear_beta)
    gen = torch.Generator().manual_seed(6)
    g, u = (8 * torch.randn(7, 45, generator=gen)).to(dtype), (4 * torch.randn(7, 45, generator=gen)).to(dtype)
    y, ref = glu_mul(g, u, 4.0, linear_beta), act(g, u)  # CPU tensors: act takes the PyTorch path
    # fp32: the kernel's tanh is within ~4e-7 of torch's; bf16: one rounding, truncated by the interpreter
    assert y.dtype == dtype
    if dtype == torch.float32:
        assert ((y - ref).abs() <= 1e-5 * (1 + ref.abs())).all()
    else:
        assert bf16_ulps(y, ref) <= 1


@needs_triton
@pytest.mark.parametrize("T,E,D,k,renorm", [(1, 64, 200, 8, True), (3, 40, 64, 6, False), (2, 896, 96, 16, True),
                                            (2, 8, 32, 1, True)])
def test_route_topk(T, E, D, k, renorm):
    from kimi3_kernels.moe_decode import route_topk, route_topk_ref
    gen = torch.Generator().manual_seed(E + k)
    x, w = torch.randn(T, D, generator=gen).bfloat16(), torch.randn(E, D, generator=gen).bfloat16()
    bias = 0.1 * torch.randn(E, generator=gen)
    logits, wts, idx = route_topk(x, w, bias, k, renorm, 2.5)
    rlogits, rwts, ridx = route_topk_ref(x, w, bias, k, renorm, 2.5)
    assert rel(logits, rlogits) < 1e-6  # fp32 sums of exact bf16 products, another order
    for t in range(T):  # the same experts (topk's order is unspecified), the same weights per expert
        mine = dict(zip(idx[t].tolist(), wts[t].tolist()))
        ref = dict(zip(ridx[t].tolist(), rwts[t].tolist()))
        assert mine.keys() == ref.keys() and all(abs(mine[e] - ref[e]) < 1e-6 for e in ref)
    with pytest.raises(ValueError):
        route_topk(x, w, bias[:-1], k, renorm, 1.0)


# slow (make test-all): each fused kernel has its own case here (convs, gated norm, router, GEMVs, projections, AttnRes
# mix), and the GPU suite runs the fused decode compiled against the CPU model (tests/gpu: fused on and off, static cache)
@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_model_fused_decode_equals_general_path(kind, monkeypatch):
    """The model's decode with the fused path (convs and output norm in one launch each, states in place; the
    two-launch router; per-route expert GEMVs for SiLU experts) against the general path (PyTorch convs, norm,
    router and experts, reference recurrence): logits of every step, fp32, B=2, with one-token and three-token
    (verification) steps after the prefill."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from kimi3_testing import tiny_model
    from transformers_kimi3 import kda as kda_layer
    from transformers_kimi3.cache import Kimi3Cache

    # 4 layers (KDA, KDA, MLA, KDA; the first dense): every kind of layer and, for K3, two AttnRes blocks
    lac = dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, kda_layers=[1, 2, 4], full_attn_layers=[3])
    over = (dict(num_hidden_layers=4, attn_res_block_size=2,
                 linear_attn_config=dict(lac, gate_lower_bound=-5.0, use_full_rank_gate=True)) if kind == "k3" else
            dict(num_hidden_layers=4, attn_res_block_size=None, hidden_act="silu", routed_expert_hidden_size=None,
                 latent_moe_use_norm=False, linear_attn_config=dict(lac, use_full_rank_gate=False)))
    model = tiny_model(seed=4, **over)
    from transformers_kimi3 import kernels
    from transformers_kimi3 import moe as moe_mod
    gemv, routed = [], []
    # router, SiLU-GLU, expert GEMVs and the AttnRes mix under the interpreter, on CPU tensors
    monkeypatch.setattr(kernels, "kernel_device", lambda t: True)
    mixes = []
    real_mix = kernels.attn_res_ops.attn_res_mix
    monkeypatch.setattr(kernels.attn_res_ops, "attn_res_mix", lambda *a: mixes.append(1) or real_mix(*a))
    real_route = kernels.moe_ops.route_topk
    monkeypatch.setattr(kernels.moe_ops, "route_topk", lambda *a, **kw: routed.append(1) or real_route(*a, **kw))
    if kind == "kimi_linear":  # SiLU experts: decode steps of <= 16 routes take the per-route GEMV
        real = kernels.moe_ops.expert_gemv
        monkeypatch.setattr(kernels.moe_ops, "expert_gemv", lambda *a, **kw: gemv.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=gen)
    steps = [torch.randint(3, model.config.vocab_size, (2, n), generator=gen) for n in (1, 3, 1)]
    fused, convs = [], []
    real_conv = kernels.kda_ops.short_conv
    monkeypatch.setattr(kernels.kda_ops, "short_conv", lambda *a: convs.append(1) or real_conv(*a))
    monkeypatch.setattr(kda_layer.Kimi3DeltaAttention, "_fused_decode",
                        lambda self, *a, _f=kda_layer.Kimi3DeltaAttention._fused_decode: fused.append(1) or _f(self, *a))
    projected = []
    real_linears = kernels.linear_ops.linears
    monkeypatch.setattr(kernels.linear_ops, "linears", lambda *a, **kw: projected.append(len(a[0])) or real_linears(*a, **kw))
    logits = {}
    # the general path with a dynamic cache; the fused one with a dynamic and with a static cache (its buffers are
    # updated in place, as a captured graph needs)
    for run, backend, max_length in (("torch", "torch", None), ("triton", "triton", None),
                                     ("triton_static", "triton", 32)):
        monkeypatch.setattr(kda_layer, "resolve_kda_backend", lambda device, requested=None, announce=True, b=backend: b)
        monkeypatch.setattr(moe_mod, "GEMV_MAX_ROUTES", 16)
        # the general path: every fused inference kernel off (router, GEMVs, AttnRes mix, convs, norm)
        monkeypatch.setenv("KIMI3_INFERENCE_KERNELS", "1" if backend == "triton" else "0")
        cache = Kimi3Cache(model.config, max_length=max_length)
        with torch.no_grad():
            out = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            out += [model(input_ids=s, past_key_values=cache, use_cache=True).logits for s in steps]
        logits[run] = out
    n_kda = len(model.config.linear_attn_config["kda_layers"])
    assert len(fused) == 2 * n_kda * len(steps)  # every KDA layer of every step after the prefill went fused
    # ... with its projections in two launches: the six that read x, then the gates' second halves (one with K3's
    # full-rank output gate, two with Kimi Linear's low-rank one)
    full = hasattr(next(m for m in model.modules() if isinstance(m, kda_layer.Kimi3DeltaAttention)), "g_proj")
    assert projected == [6, 1 if full else 2] * (2 * n_kda * len(steps)) and full == (kind == "k3")
    assert len(convs) == 2 * n_kda * 3  # the prefills' q/k/v convs: one kernel launch each
    assert bool(mixes) == (kind == "k3")  # AttnRes (K3 only) mixed by the kernel in the fused runs
    n_moe = sum(hasattr(layer, "block_sparse_moe") for layer in model.model.layers)
    assert len(gemv) == (2 * n_moe * len(steps) if kind == "kimi_linear" else 0)  # B=2 x (1 or 3) tokens x top-2
    assert len(routed) == 2 * n_moe * len(steps)
    for run in ("triton", "triton_static"):
        for a, b in zip(logits[run], logits["torch"]):
            assert rel(a, b) < 1e-4, (run, rel(a, b))
