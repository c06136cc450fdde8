"""Several bias-free linear layers of a few rows in one launch (decode).

A KDA layer's decode step projects its input six times (q, k, v, the gate's and the output gate's low-rank
halves, beta), and then twice more (the gates' second halves). Each projection is a separate cuBLAS call: a
launch of a few microseconds on the GPU, and 20-50 us of host time in an eager step (bench/results/
decode_host_profile_h200_4086912.txt). The narrow ones (128 or H rows) move ~1 MB and are pure latency.

    ys = linears(xs, weights)     # ys[i] = xs[i] @ weights[i].T, every x [M, K] with the same M <= MAX_ROWS and K

One program per BN output rows of one weight, the weights' tiles numbered one after another; each streams its rows
once and multiplies them with the (padded) rows of its input on the tensor cores, accumulating in fp32 as cuBLAS
does. The outputs are contiguous [M, N_i] views of one buffer. `linears_ref` is the same in PyTorch. Runs under
TRITON_INTERPRET=1 on CPU tensors (CI).
"""
import torch
import torch.nn.functional as F

from . import _launch
from ._host import cdiv, interpreter_enabled, next_pow2

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # noqa: BLE001 - optional
    HAS_TRITON = False

MAX_PAIRS = 6
MAX_ROWS = 16  # the tensor-core tile's height; more rows are a GEMM, for cuBLAS
_NO_TILE = 2 ** 31 - 1  # the first tile of an unused slot: never reached

if HAS_TRITON:
    @triton.jit
    def _linears_kernel(x0, x1, x2, x3, x4, x5, w0, w1, w2, w3, w4, w5, y, M, K,
                        N0, N1, N2, N3, N4, N5, T1, T2, T3, T4, T5, P1, P2, P3, P4, P5,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        OP_F32: tl.constexpr):
        pid = tl.program_id(0)
        # T_i: pair i's first tile; P_i: its first output column, counting every pair's columns in a row
        s = ((pid >= T1).to(tl.int32) + (pid >= T2).to(tl.int32) + (pid >= T3).to(tl.int32)
             + (pid >= T4).to(tl.int32) + (pid >= T5).to(tl.int32))
        if s == 0:
            x, w = x0, w0
        elif s == 1:
            x, w = x1, w1
        elif s == 2:
            x, w = x2, w2
        elif s == 3:
            x, w = x3, w3
        elif s == 4:
            x, w = x4, w4
        else:
            x, w = x5, w5
        N = tl.where(s == 0, N0, tl.where(s == 1, N1, tl.where(s == 2, N2, tl.where(s == 3, N3, tl.where(
            s == 4, N4, N5)))))
        t0 = tl.where(s == 0, 0, tl.where(s == 1, T1, tl.where(s == 2, T2, tl.where(s == 3, T3, tl.where(
            s == 4, T4, T5)))))
        p0 = tl.where(s == 0, 0, tl.where(s == 1, P1, tl.where(s == 2, P2, tl.where(s == 3, P3, tl.where(
            s == 4, P4, P5)))))
        n = (pid - t0) * BN + tl.arange(0, BN)
        mn = n < N
        m = tl.arange(0, BM)
        mm = m < M
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk < K
            xt = tl.load(x + m[:, None] * K + kk[None, :], mask=mm[:, None] & mk[None, :], other=0.)
            wt = tl.load(w + n[:, None].to(tl.int64) * K + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
            if OP_F32:  # the interpreter's dot mishandles bf16; bf16 products are exact in fp32
                xt, wt = xt.to(tl.float32), wt.to(tl.float32)
            acc += tl.dot(xt, tl.trans(wt), input_precision=PREC)
        # output i: the [M, N_i] block that starts at M * P_i
        out = y + p0.to(tl.int64) * M + m[:, None] * N + n[None, :]
        tl.store(out, acc.to(y.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _check(xs, weights):
    if not 1 <= len(xs) == len(weights) <= MAX_PAIRS:
        raise ValueError(f"linears: 1 to {MAX_PAIRS} (input, weight) pairs, got {len(xs)} inputs and "
                         f"{len(weights)} weights")
    M, K = xs[0].shape if xs[0].dim() == 2 else (None, None)
    for i, (x, w) in enumerate(zip(xs, weights)):
        if x.dim() != 2 or x.shape != (M, K) or w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"linears: pair {i}: input {tuple(x.shape)}, weight {tuple(w.shape)}; every input must "
                             f"be [M, K] = {[M, K]} and every weight [N, K]")
        if x.dtype != xs[0].dtype or w.dtype != x.dtype or x.device != w.device or x.device != xs[0].device:
            raise ValueError(f"linears: pair {i}: input {x.dtype} on {x.device}, weight {w.dtype} on {w.device}; "
                             "one dtype and one device for all")
        if not w.is_contiguous():
            raise ValueError(f"linears: weight {i} must be contiguous")
    if M > MAX_ROWS:
        raise ValueError(f"linears: at most {MAX_ROWS} rows (a GEMM beyond that), got {M}")
    return M, K


def linears(xs, weights, BN=32, BK=256, num_warps=4, num_stages=3, check=True):
    """ys[i] = xs[i] @ weights[i].T for up to MAX_PAIRS pairs in one launch. xs: [M, K] each (one M <= MAX_ROWS,
    one K), weights: [N_i, K] contiguous, all of one dtype and device. Returns [M, N_i] tensors in that dtype.
    check=False skips the argument checks (a caller that has made them; this runs at every decode step)."""
    M, K = _check(xs, weights) if check else xs[0].shape
    BK = min(BK, max(16, next_pow2(K)))
    ns = [w.shape[0] for w in weights]
    buf = torch.empty(M * sum(ns), device=xs[0].device, dtype=xs[0].dtype)
    starts, cols = [0], [0]
    for n in ns:
        starts.append(starts[-1] + cdiv(n, BN))
        cols.append(cols[-1] + n)
    ys = tuple(y.view(M, n) for y, n in zip(buf.split([M * n for n in ns]), ns))
    if M and starts[-1]:
        pad = MAX_PAIRS - len(ns)
        xs = [x.contiguous() for x in xs] + [xs[0]] * pad
        ws = list(weights) + [weights[0]] * pad
        tiles = starts[1:len(ns)] + [_NO_TILE] * (pad + 1)
        f32 = interpreter_enabled()
        prec = "ieee" if xs[0].dtype == torch.float32 or f32 else "tf32"  # fp32 models: fp32 products (F.linear's)
        _launch.launch(_linears_kernel, (starts[-1],),
                       (*xs, *ws, buf, M, K, *(ns + [0] * pad), *tiles[:5], *(cols[1:len(ns)] + [0] * (pad + 1))[:5]),
                       BM=MAX_ROWS, BN=BN, BK=BK, PREC=prec, OP_F32=f32, num_warps=num_warps, num_stages=num_stages)
    return ys


def linears_ref(xs, weights):
    return tuple(F.linear(x, w) for x, w in zip(xs, weights))
