"""Several bias-free linear layers of a few rows in one launch (decode).

A KDA layer's decode step projects its input six times (q, k, v, the gate's and the output gate's low-rank
halves, beta), and then twice more (the gates' second halves). Each projection is a separate cuBLAS call: a
launch of a few microseconds on the GPU, and tens of microseconds of host time in an eager step. The narrow ones (128 or H rows) move ~1 MB and are pure latency.

    ys = linears(xs, weights)   # ys[i] = xs[i] @ weights[i].T; every x [..., K] of one shape, at most MAX_ROWS rows

One program per BN output rows of one weight, the weights' tiles numbered one after another; each streams its rows
once and multiplies them with the (padded) rows of its input on the tensor cores, accumulating in fp32 as cuBLAS
does. `linears_ref` is the same in PyTorch. Runs under TRITON_INTERPRET=1 on CPU tensors (CI).
"""
import functools

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
    def _linears_kernel(x0, x1, x2, x3, x4, x5, w0, w1, w2, w3, w4, w5, y0, y1, y2, y3, y4, y5, M, K,
                        N0, N1, N2, N3, N4, N5, T1, T2, T3, T4, T5,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        OP_F32: tl.constexpr):
        pid = tl.program_id(0)
        # T_i: pair i's first tile (the pairs' tiles are numbered one after another)
        s = ((pid >= T1).to(tl.int32) + (pid >= T2).to(tl.int32) + (pid >= T3).to(tl.int32)
             + (pid >= T4).to(tl.int32) + (pid >= T5).to(tl.int32))
        if s == 0:
            x, w, y = x0, w0, y0
        elif s == 1:
            x, w, y = x1, w1, y1
        elif s == 2:
            x, w, y = x2, w2, y2
        elif s == 3:
            x, w, y = x3, w3, y3
        elif s == 4:
            x, w, y = x4, w4, y4
        else:
            x, w, y = x5, w5, y5
        N = tl.where(s == 0, N0, tl.where(s == 1, N1, tl.where(s == 2, N2, tl.where(s == 3, N3, tl.where(
            s == 4, N4, N5)))))
        t0 = tl.where(s == 0, 0, tl.where(s == 1, T1, tl.where(s == 2, T2, tl.where(s == 3, T3, tl.where(
            s == 4, T4, T5)))))
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
        tl.store(y + m[:, None] * N + n[None, :], acc.to(y.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _check(xs, weights):
    if not 1 <= len(xs) == len(weights) <= MAX_PAIRS:
        raise ValueError(f"linears: 1 to {MAX_PAIRS} (input, weight) pairs, got {len(xs)} inputs and "
                         f"{len(weights)} weights")
    shape = xs[0].shape
    K = shape[-1] if len(shape) else None
    for i, (x, w) in enumerate(zip(xs, weights)):
        if not len(shape) or x.shape != shape or w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"linears: pair {i}: input {tuple(x.shape)}, weight {tuple(w.shape)}; every input must "
                             f"have one shape [..., K] = {list(shape)} and every weight [N, K]")
        if x.dtype != xs[0].dtype or w.dtype != x.dtype or x.device != w.device or x.device != xs[0].device:
            raise ValueError(f"linears: pair {i}: input {x.dtype} on {x.device}, weight {w.dtype} on {w.device}; "
                             "one dtype and one device for all")
        if not w.is_contiguous():
            raise ValueError(f"linears: weight {i} must be contiguous")
    if xs[0].numel() // max(K, 1) > MAX_ROWS:
        raise ValueError(f"linears: at most {MAX_ROWS} rows (a GEMM beyond that), got {list(shape)}")


@functools.lru_cache(maxsize=1024)
def _tiles(ns, BN):
    """(T_1 .. T_5, the grid): each pair's first tile; the slots after the last pair start past every program."""
    starts = [0]
    for n in ns:
        starts.append(starts[-1] + cdiv(n, BN))
    return tuple(starts[1:-1]) + (_NO_TILE,) * (MAX_PAIRS - len(ns)), starts[-1]


def linears(xs, weights, BN=32, BK=256, num_warps=4, num_stages=3, check=True):
    """ys[i] = xs[i] @ weights[i].T for up to MAX_PAIRS pairs in one launch. xs: [..., K], one shape for all, with
    at most MAX_ROWS rows; weights: [N_i, K] contiguous; all of one dtype and device. Returns contiguous
    [..., N_i] tensors in that dtype. check=False skips the argument checks (for a caller that has made them: this
    runs at every decode step)."""
    if check:
        _check(xs, weights)
    x0 = xs[0]
    lead = x0.shape[:-1]
    K = x0.shape[-1]
    M = x0.numel() // K if K else 0
    ns = tuple([w.shape[0] for w in weights])
    ys = tuple([x0.new_empty(lead + (n,)) for n in ns])
    tiles, grid = _tiles(ns, BN)
    if M and grid:
        pad = MAX_PAIRS - len(ns)  # unused slots: any pointer, no rows
        f32 = interpreter_enabled()
        _launch.launch(
            _linears_kernel, (grid,),
            (*[x.contiguous() for x in xs], *[x0] * pad, *weights, *[weights[0]] * pad, *ys, *[ys[0]] * pad, M, K,
             *ns, *[0] * pad, *tiles),
            BM=MAX_ROWS, BN=BN, BK=min(BK, max(16, next_pow2(K))), PREC="ieee" if f32 or x0.dtype == torch.float32
            else "tf32", OP_F32=f32, num_warps=num_warps, num_stages=num_stages)  # fp32: fp32 products (F.linear's)
    return ys


def linears_ref(xs, weights):
    return tuple(F.linear(x, w) for x, w in zip(xs, weights))
