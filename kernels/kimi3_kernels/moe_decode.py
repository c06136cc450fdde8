"""Routed experts for a handful of tokens (decode), bf16/fp32 weights, without sorting the routes.

At decode a layer sees T * top_k routes of one or a few tokens each. The grouped-GEMM path sorts the routes by
expert, counts them, gathers the rows, runs three grouped GEMMs and scatters back: about 30 launches per layer,
each a few microseconds, for ~100 MB of weights that take ~30 us to read. Here each route reads its expert id
from `topk_idx` directly:

    h[r]    = act(x[r // k] @ W1[e_r]^T, x[r // k] @ W3[e_r]^T)          (gate/up, one launch)
    o[r]    = h[r] @ W2[e_r]^T                                             (down, one launch)
    y[t]    = sum_j  w[t, j] * o[t k + j]                                  (weighted sum, one launch)

Rounding follows the grouped-GEMM path (`transformers_kimi3.moe.Kimi3Experts`): the GEMM outputs are rounded to
the weights' dtype, the activation is computed in fp32 and rounded, each expert's down output is rounded before
the fp32 weighted sum; with fp32 weights and inputs every product and sum is fp32 (elementwise products and
tl.sum, no tl.dot and so no TF32), so an fp32 model keeps fp32 values. SiLU-GLU only (Kimi Linear; K3's SiTU
stays on the general path). Routes to index `num_experts` (another rank's expert under expert parallelism,
weight 0) are skipped. Inference only (no backward).

`route_topk` is the sigmoid router for the same few tokens in two launches instead of ~12, `glu_mul` the GLU (SiLU
or K3's SiTU) in one launch instead of 5 (SiTU: 11), `mlp_gemv` one token through a dense MLP. For prefill,
`combine_sorted` sums the grouped GEMM's expert-sorted outputs per token in one launch. Runs under
TRITON_INTERPRET=1 on CPU tensors (CI); the references are `expert_gemv_ref` and `route_topk_ref`.
"""
import torch
import torch.nn.functional as F

from . import _launch
from ._host import cdiv, next_pow2

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # noqa: BLE001 - optional
    HAS_TRITON = False

if HAS_TRITON:
    @triton.jit
    def _gate_up_kernel(x, w1, w3, idx, h, E, I, D, KTOP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        ONE_EXPERT: tl.constexpr = False):
        r = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        e = tl.full([], 0, tl.int64) if ONE_EXPERT else tl.load(idx + r).to(tl.int64)
        if e < E:
            t = r // KTOP
            mn = n < I
            acc1 = tl.zeros([BN], dtype=tl.float32)
            acc3 = tl.zeros([BN], dtype=tl.float32)
            for k0 in range(0, D, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk < D
                xv = tl.load(x + t * D + kk, mask=mk, other=0.).to(tl.float32)
                off = (e * I + n[:, None]) * D + kk[None, :]
                m = mn[:, None] & mk[None, :]
                acc1 += tl.sum(tl.load(w1 + off, mask=m, other=0.).to(tl.float32) * xv[None, :], 1)
                acc3 += tl.sum(tl.load(w3 + off, mask=m, other=0.).to(tl.float32) * xv[None, :], 1)
            g = acc1.to(h.dtype.element_ty).to(tl.float32)  # the GEMM outputs' rounding
            u = acc3.to(h.dtype.element_ty).to(tl.float32)
            tl.store(h + r * I + n, (g * tl.sigmoid(g) * u).to(h.dtype.element_ty), mask=mn)

    @triton.jit
    def _down_kernel(h, w2, idx, o, E, I, D, BN: tl.constexpr, BK: tl.constexpr, ONE_EXPERT: tl.constexpr = False):
        r = tl.program_id(0)  # one route per program row: every route's weights stream in parallel
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        mn = n < D
        e = tl.full([], 0, tl.int64) if ONE_EXPERT else tl.load(idx + r).to(tl.int64)
        acc = tl.zeros([BN], dtype=tl.float32)
        if e < E:
            for k0 in range(0, I, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk < I
                hv = tl.load(h + r * I + kk, mask=mk, other=0.).to(tl.float32)
                wv = tl.load(w2 + (e * D + n[:, None]) * I + kk[None, :], mask=mn[:, None] & mk[None, :],
                             other=0.).to(tl.float32)
                acc += tl.sum(wv * hv[None, :], 1)
        tl.store(o + r * D + n, acc.to(o.dtype.element_ty), mask=mn)

    @triton.jit
    def _combine_kernel(o, wts, y, D, KTOP: tl.constexpr, BN: tl.constexpr):
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        mn = n < D
        out = tl.zeros([BN], dtype=tl.float32)
        for j in range(KTOP):  # fixed order: the same sum every run
            out += tl.load(wts + t * KTOP + j) * tl.load(o + (t * KTOP + j) * D + n, mask=mn, other=0.).to(tl.float32)
        tl.store(y + t * D + n, out, mask=mn)


    @triton.jit
    def _combine_sorted_kernel(o, inv, idx, wts, y, E, D, KTOP: tl.constexpr, BN: tl.constexpr):
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        mn = n < D
        out = tl.zeros([BN], dtype=tl.float32)
        for j in range(KTOP):  # fixed order, as _combine_kernel
            r = t * KTOP + j
            if tl.load(idx + r) < E:  # another rank's expert: not computed, its row is garbage
                row = tl.load(inv + r).to(tl.int64)
                out += tl.load(wts + r) * tl.load(o + row * D + n, mask=mn, other=0.).to(tl.float32)
        tl.store(y + t.to(tl.int64) * D + n, out, mask=mn)

    @triton.jit
    def _router_logits_kernel(x, w, logits, E, D, BE: tl.constexpr, BK: tl.constexpr):
        t = tl.program_id(0)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        me = e < E
        acc = tl.zeros([BE], dtype=tl.float32)
        for k0 in range(0, D, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk < D
            xv = tl.load(x + t * D + kk, mask=mk, other=0.).to(tl.float32)
            wv = tl.load(w + e[:, None].to(tl.int64) * D + kk[None, :], mask=me[:, None] & mk[None, :],
                         other=0.).to(tl.float32)
            acc += tl.sum(wv * xv[None, :], 1)
        tl.store(logits + t * E + e, acc, mask=me)

    @triton.jit
    def _router_topk_kernel(logits, bias, idx, wts, E, scale, KTOP: tl.constexpr, K_POW2: tl.constexpr,
                            E_POW2: tl.constexpr, RENORM: tl.constexpr):
        t = tl.program_id(0)
        e = tl.arange(0, E_POW2)
        me = e < E
        score = tl.sigmoid(tl.load(logits + t * E + e, mask=me, other=0.))
        choice = tl.where(me, score + tl.load(bias + e, mask=me, other=0.), float("-inf"))
        j = tl.arange(0, K_POW2)
        mj = j < KTOP
        picked = tl.zeros([K_POW2], dtype=tl.int32)
        for i in tl.static_range(KTOP):  # k rounds of max: the k largest, lowest index first among equals
            best = tl.max(choice, 0)
            sel = tl.min(tl.where(choice == best, e, E_POW2), 0)
            picked = tl.where(j == i, sel, picked)
            choice = tl.where(e == sel, float("-inf"), choice)
        w = tl.where(mj, tl.sigmoid(tl.load(logits + t * E + picked, mask=mj, other=0.)), 0.)
        if RENORM:
            w = w / (tl.sum(w, 0) + 1e-20)
        tl.store(idx + t * KTOP + j, picked.to(tl.int64), mask=mj)
        tl.store(wts + t * KTOP + j, w * scale, mask=mj)

    @triton.jit
    def _tanh(x):
        """tanh to a few fp32 ulps, for fp32 models too: below |x| = 0.3 its odd Taylor polynomial to x^11 (next
        term < 2e-9 relative), above it 1 - 2 / (exp(2|x|) + 1), whose cancellation costs at most ~2e-7 there.
        (Forms like 2 sigmoid(2x) - 1 lose the relative precision of small x.)"""
        a = tl.abs(x)
        x2 = x * x
        p = x * (1. + x2 * (-1. / 3. + x2 * (2. / 15. + x2 * (-17. / 315. + x2 * (62. / 2835.
                                                                                 + x2 * (-1382. / 155925.))))))
        t = 1. - 2. / (tl.exp(2. * tl.minimum(a, 20.)) + 1.)  # tanh(20) == 1 in fp32; keeps exp finite
        return tl.where(a < 0.3, p, tl.where(x < 0, -t, t))

    @triton.jit
    def _glu_mul_kernel(g, u, y, N, beta, linear_beta, SITU: tl.constexpr, LINEAR_BETA: tl.constexpr,
                        BLOCK: tl.constexpr):
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # prefill tensors may pass 2^31
        m = o < N
        gv = tl.load(g + o, mask=m, other=0.).to(tl.float32)
        uv = tl.load(u + o, mask=m, other=0.).to(tl.float32)
        if SITU:  # SiTU_b(g) = b tanh(g / b) sigmoid(g); the up branch b2 tanh(u / b2)
            act = beta * _tanh(gv / beta) * tl.sigmoid(gv)
            if LINEAR_BETA:
                uv = linear_beta * _tanh(uv / linear_beta)
        else:
            act = gv * tl.sigmoid(gv)
        tl.store(y + o, (act * uv).to(y.dtype.element_ty), mask=m)


def route_topk(x, weight, bias, top_k, renormalize, scaling):
    """The sigmoid router for a few tokens in two launches: fp32 logits of x [T, D] against weight [E, D] (bf16
    products are exact in fp32), then per token the top_k of sigmoid(logits) + bias, their unbiased scores
    (renormalised when asked) times `scaling`. Returns (logits fp32 [T, E], weights fp32 [T, k], idx int64 [T, k]),
    as `transformers_kimi3.moe.Kimi3TopkRouter` (without expert groups); `route_topk_ref` restates it."""
    T, D = x.shape
    E = weight.shape[0]
    if weight.shape != (E, D) or bias.shape != (E,) or not 0 < top_k <= E:
        raise ValueError(f"route_topk: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias {tuple(bias.shape)}, "
                         f"top_k {top_k}")
    x, weight = x.contiguous(), weight.contiguous()
    logits = torch.empty(T, E, device=x.device, dtype=torch.float32)
    idx = torch.empty(T, top_k, device=x.device, dtype=torch.int64)
    wts = torch.empty(T, top_k, device=x.device, dtype=torch.float32)
    if T == 0:
        return logits, wts, idx
    # many small programs: the router matrix (0.3 MB at 64 experts, 13 MB for K3's 896) is read at one token
    BE, BK = (2, 512) if E <= 128 else (8, 256)
    _launch.launch(_router_logits_kernel, (T, cdiv(E, BE)), (x, weight, logits, E, D), BE=BE, BK=BK, num_warps=4)
    # one warp: the k rounds of max / argmax are warp shuffles, no block-wide barriers
    _launch.launch(_router_topk_kernel, (T,), (logits, bias.float().contiguous(), idx, wts, E, float(scaling)),
                   KTOP=top_k, K_POW2=next_pow2(top_k), E_POW2=next_pow2(E),
                   RENORM=bool(renormalize and top_k > 1), num_warps=1)
    return logits, wts, idx


def glu_mul(gate, up, situ_beta=None, linear_beta=None):
    """act(gate) * up in fp32, rounded to gate's dtype, one launch: SiLU, or with `situ_beta` K3's SiTU-GLU
    SiTU_b(gate) * b2 tanh(up / b2) (b2 = `linear_beta`, None: up as is), ~11 launches in PyTorch. Same shapes."""
    if gate.shape != up.shape:
        raise ValueError(f"glu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    N = g.numel()
    if N:
        _launch.launch(_glu_mul_kernel, (cdiv(N, 1024),),
                       (g, u, y, N, float(situ_beta or 1.), float(linear_beta or 1.)), SITU=situ_beta is not None,
                       LINEAR_BETA=linear_beta is not None, BLOCK=1024, num_warps=4)
    return y


def expert_gemv(x, w1, w3, w2, topk_idx, topk_weights, BN=16, BK=128):
    """x [T, D]; w1, w3 [E, I, D]; w2 [E, D, I]; topk_idx [T, k] int; topk_weights [T, k]. Returns fp32 [T, D]:
    sum_j w[t, j] * SiLU-GLU expert e_tj of x[t]. Three launches: gate/up and down with one program per
    (route, BN outputs), then the weighted sum in a fixed order."""
    T, D = x.shape
    E, I, _ = w1.shape
    k = topk_idx.shape[1]
    for name, w, shape in (("w1", w1, (E, I, D)), ("w3", w3, (E, I, D)), ("w2", w2, (E, D, I))):
        if tuple(w.shape) != shape or not w.is_contiguous():
            raise ValueError(f"expert_gemv: {name} must be a contiguous {shape}, got {tuple(w.shape)}")
    x = x.to(w1.dtype).contiguous()
    idx = topk_idx.contiguous()
    h = torch.empty(T * k, I, device=x.device, dtype=w1.dtype)
    o = torch.empty(T * k, D, device=x.device, dtype=w1.dtype)
    if T == 0:
        return torch.empty(T, D, device=x.device, dtype=torch.float32)
    _launch.launch(_gate_up_kernel, (T * k, cdiv(I, BN)), (x, w1, w3, idx, h, E, I, D), KTOP=k, BN=BN, BK=BK,
                   num_warps=4)
    _launch.launch(_down_kernel, (T * k, cdiv(D, 2 * BN)), (h, w2, idx, o, E, I, D), BN=2 * BN, BK=BK, num_warps=4)
    return combine_routes(o, topk_weights.float(), torch.float32)


def combine_routes(out, topk_weights, out_dtype):
    """y[t] = sum_j w[t, j] * out[t k + j] for route outputs in topk order (out [T*k, D]), summed in fp32 in a fixed
    order and stored as out_dtype: one launch."""
    T, k = topk_weights.shape
    D = out.shape[-1]
    y = torch.empty(T, D, device=out.device, dtype=out_dtype)
    if T:
        _launch.launch(_combine_kernel, (T, cdiv(D, 1024)), (out.contiguous(), topk_weights.contiguous(), y, D),
                       KTOP=k, BN=1024, num_warps=4)
    return y


def mlp_gemv(x, gate, up, down, BN=8, BN_DOWN=16, BK=128):
    """One token through a dense SiLU-GLU MLP (a shared expert): x [1, D]; gate, up [I, D]; down [D, I]. Returns
    [1, D] in the weights' dtype, rounded as Kimi3MLP (each projection's output, then the fp32 GLU). Two launches of
    the expert kernels instead of four; cuBLAS gives a one-row 2304 -> 1024 projection a tile that streams its
    weights at a tenth of the bandwidth. Each row re-reads the weights: one token only."""
    I, D = gate.shape
    if x.shape != (1, D) or up.shape != (I, D) or down.shape != (D, I):
        raise ValueError(f"mlp_gemv: x {tuple(x.shape)}, gate {tuple(gate.shape)}, up {tuple(up.shape)}, "
                         f"down {tuple(down.shape)}")
    if not (gate.is_contiguous() and up.is_contiguous() and down.is_contiguous()):
        raise ValueError("mlp_gemv: weights must be contiguous")
    x = x.to(gate.dtype).contiguous()
    h = torch.empty(1, I, device=x.device, dtype=gate.dtype)
    o = torch.empty(1, D, device=x.device, dtype=gate.dtype)
    _launch.launch(_gate_up_kernel, (1, cdiv(I, BN)), (x, gate, up, x, h, 1, I, D), KTOP=1, BN=BN, BK=BK,
                   ONE_EXPERT=True, num_warps=4)
    _launch.launch(_down_kernel, (1, cdiv(D, BN_DOWN)), (h, down, x, o, 1, I, D), BN=BN_DOWN, BK=BK, ONE_EXPERT=True,
                   num_warps=4)
    return o


def combine_sorted(out, order, topk_idx, topk_weights, num_experts):
    """The weighted sum of expert outputs computed in expert-sorted order (grouped GEMM, prefill): out [T*k, D] holds
    route order[i] in row i. Returns fp32 [T, D] = sum_j w[t, j] out[row of route (t, j)], summed in a fixed order,
    routes to index `num_experts` (another rank's expert) skipped. One launch in place of unsorting the rows
    (index_copy), masking, casting to fp32 and the weighted sum: ~4 GB of traffic per layer at 8K tokens x top-8."""
    T, k = topk_idx.shape
    D = out.shape[-1]
    if out.shape[0] != T * k or order.shape != (T * k,) or topk_weights.shape != (T, k):
        raise ValueError(f"combine_sorted: out {tuple(out.shape)}, order {tuple(order.shape)}, topk_idx "
                         f"{tuple(topk_idx.shape)}, topk_weights {tuple(topk_weights.shape)}")
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y = torch.empty(T, D, device=out.device, dtype=torch.float32)
    if T:
        _launch.launch(_combine_sorted_kernel, (T, cdiv(D, 1024)),
                       (out.contiguous(), inv, topk_idx.contiguous(), topk_weights.float().contiguous(), y,
                        num_experts, D), KTOP=k, BN=1024, num_warps=4)
    return y


def expert_gemv_ref(x, w1, w3, w2, topk_idx, topk_weights):
    """Per-route loop in PyTorch with the rounding described in the module docstring."""
    T, k = topk_idx.shape
    E = w1.shape[0]
    y = torch.zeros(T, w2.shape[1], dtype=torch.float32, device=x.device)
    xw = x.to(w1.dtype)
    for t in range(T):
        for j in range(k):
            e = int(topk_idx[t, j])
            if e >= E:
                continue
            g, u = (xw[t] @ w1[e].T).float(), (xw[t] @ w3[e].T).float()
            hh = (F.silu(g) * u).to(w1.dtype)
            y[t] += topk_weights[t, j].float() * (hh @ w2[e].T).float()
    return y


def route_topk_ref(x, weight, bias, top_k, renormalize, scaling):
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid()
    idx = (scores + bias.float()).topk(top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    if renormalize and top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return logits, w * scaling, idx
