"""The small per-token operations around the KDA recurrence, one launch each for decode.

A decode step of a KDA layer otherwise spends ~20 launches on them (per conv: concatenate, conv, SiLU, state copy;
the output norm: casts, RMS, sigmoid, products), each a few microseconds for a few KB of data; at batch 1 such
launches are most of a CUDA-graph-replayed step.

- `short_conv_update(xs, states, weights)`: the depthwise causal convs + SiLU of q, k and v for T new tokens
  (decode, speculative verification) in one launch, the conv states [B, D, W] updated in place.
- `gated_rms_norm(x, gate, weight, eps)`: RMSNorm(x) * weight * sigmoid(gate) in fp32, cast to x's dtype.
- `short_conv(x, weight, state)`: the same conv + SiLU for a whole prompt (or prompt chunk) in one launch, inference.

References (same signatures' math): `transformers_kimi3.kda.causal_conv` and `transformers_kimi3.norms.
Kimi3GatedRMSNorm`; `short_conv_update_ref` / `gated_rms_norm_ref` below restate them for the tests.
Both kernels run under TRITON_INTERPRET=1 on CPU tensors (CI).
"""
import torch
import torch.nn.functional as F

from .. import _launch
from ._utils import TRITON_AVAILABLE, cdiv, next_pow2

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _conv_update_kernel(x0, x1, x2, s0, s1, s2, w0, w1, w2, y0, y1, y2, D,
                            T: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr):
        i_b, i_d, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if which == 0:
            x, s, w, y = x0, s0, w0, y0
        elif which == 1:
            x, s, w, y = x1, s1, w1, y1
        else:
            x, s, w, y = x2, s2, w2, y2
        d = i_d * BD + tl.arange(0, BD)
        md = d < D
        j = tl.arange(0, WP)
        mj = md[:, None] & (j[None, :] < W)
        s_row = s + (i_b * D + d[:, None]) * W
        x_row = x + i_b * T * D + d[:, None]
        wt = tl.load(w + d[:, None] * W + j[None, :], mask=mj, other=0.).to(tl.float32)
        # position p of the sequence (old state ++ new tokens): p < W in the state, else token p - W
        for t in tl.static_range(T):
            p = t + 1 + j[None, :]  # the window that ends at token t
            win = tl.load(s_row + p, mask=mj & (p < W), other=0.) + \
                tl.load(x_row + (p - W) * D, mask=mj & (p >= W), other=0.)
            acc = tl.sum(win.to(tl.float32) * wt, 1).to(w.dtype.element_ty).to(tl.float32)  # conv output dtype
            out = acc * tl.sigmoid(acc)
            tl.store(y + (i_b * T + t) * D + d, out.to(y.dtype.element_ty), mask=md)
        p = T + j[None, :]  # the last W positions become the state (all loaded before the store)
        new = tl.load(s_row + p, mask=mj & (p < W), other=0.) + \
            tl.load(x_row + (p - W) * D, mask=mj & (p >= W), other=0.)
        tl.store(s_row + j[None, :], new.to(s.dtype.element_ty), mask=mj)

    @triton.jit
    def _conv_fwd_kernel(x, s, w, y, T, D, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                         HAS_STATE: tl.constexpr):
        i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = i_t * BT + tl.arange(0, BT)
        d = i_d * BD + tl.arange(0, BD)
        mt, md = t < T, d < D
        x_b = x + i_b.to(tl.int64) * T * D
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(W):  # tap j reads input t - (W - 1) + j; before the prompt: the state (or 0)
            src = t - (W - 1) + j
            xv = tl.load(x_b + src[:, None] * D + d[None, :], mask=(mt & (src >= 0))[:, None] & md[None, :],
                         other=0.).to(tl.float32)
            if HAS_STATE:
                xv += tl.load(s + (i_b * D + d[None, :]) * W + (W + src[:, None]),
                              mask=(mt & (src < 0))[:, None] & md[None, :], other=0.).to(tl.float32)
            acc += xv * tl.load(w + d * W + j, mask=md, other=0.).to(tl.float32)[None, :]
        acc = acc.to(w.dtype.element_ty).to(tl.float32)  # the conv's output dtype (the weight's)
        tl.store(y + i_b.to(tl.int64) * T * D + t[:, None] * D + d[None, :],
                 (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=mt[:, None] & md[None, :])

    @triton.jit
    def _gated_norm_kernel(x, g, w, y, N, eps, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, KP)
        m = (r[:, None] < N) & (c[None, :] < K)
        off = r[:, None] * K + c[None, :]
        xv = tl.load(x + off, mask=m, other=0.).to(tl.float32)
        gv = tl.load(g + off, mask=m, other=0.).to(tl.float32)
        wv = tl.load(w + c, mask=c < K, other=0.).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xv * xv, 1) / K + eps)
        out = xv * inv[:, None] * wv[None, :] * tl.sigmoid(gv)
        tl.store(y + off, out.to(y.dtype.element_ty), mask=m)


def short_conv_update(xs, states, weights):
    """xs: three [B, T, D] tensors (T new tokens), states: three [B, D, W] (the last W inputs, updated in place),
    weights: three [D, 1, W] (tap W - 1 is the current token). Returns three [B, T, D] = SiLU(conv), x's dtype."""
    B, T, D = xs[0].shape
    W = weights[0].shape[-1]
    for x, s, w in zip(xs, states, weights):
        if x.shape != (B, T, D) or s.shape != (B, D, W) or w.shape != (D, 1, W):
            raise ValueError(f"short_conv_update: x {tuple(x.shape)}, state {tuple(s.shape)}, weight "
                             f"{tuple(w.shape)} do not fit [B, T, D] / [B, D, W] / [D, 1, W]")
        if not (s.is_contiguous() and w.is_contiguous()):
            raise ValueError("short_conv_update: states and weights must be contiguous (states update in place)")
    xs = [x.contiguous() for x in xs]
    ys = [torch.empty_like(x) for x in xs]
    BD = 128
    _launch.launch(_conv_update_kernel, (B, cdiv(D, BD), 3), (*xs, *states, *weights, *ys, D), T=T, W=W,
                   WP=next_pow2(W), BD=BD, num_warps=4)
    return tuple(ys)


def short_conv(x, weight, state=None):
    """Prefill / a chunk of a prompt: x [B, T, D]; weight [D, 1, W]; state [B, D, W] (the last W inputs before x) or
    None (zeros). Returns (SiLU(conv(x)) [B, T, D] and the new state [B, D, W], both in x's dtype). One launch in
    place of the transpose, concatenation, casts, conv and SiLU of the PyTorch path
    (`transformers_kimi3.kda.causal_conv`, ~1 ms per call at 8K tokens x 4096 channels vs ~0.05 ms). No autograd."""
    B, T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, 1, W) or (state is not None and state.shape != (B, D, W)):
        raise ValueError(f"short_conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, state "
                         f"{None if state is None else tuple(state.shape)} do not fit [B, T, D] / [D, 1, W] / "
                         "[B, D, W]")
    xc, wc = x.contiguous(), weight.contiguous()
    sc = state.to(x.dtype).contiguous() if state is not None else None  # the reference rounds it to x's dtype too
    y = torch.empty_like(xc)
    BT, BD = 32, 128
    if T:
        _conv_fwd_kernel[(cdiv(T, BT), cdiv(D, BD), B)](xc, sc if sc is not None else xc, wc, y, T, D,
                                                        W=W, BT=BT, BD=BD, HAS_STATE=sc is not None,
                                                        num_warps=4)
    prev = x.new_zeros(B, D, W) if state is None else state.to(x.dtype)
    new_state = torch.cat([prev, x[:, -W:].transpose(1, 2)], dim=-1)[..., -W:].contiguous()
    return y, new_state


def gated_rms_norm(x, gate, weight, eps):
    """x, gate [..., K]; weight [K]. RMSNorm(x) * weight * sigmoid(gate), computed in fp32, returned in x's dtype."""
    K = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (K,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight "
                         f"{tuple(weight.shape)}")
    xc, gc = x.contiguous(), gate.contiguous()
    y = torch.empty_like(xc)
    N = xc.numel() // K
    ROWS = 16
    _launch.launch(_gated_norm_kernel, (cdiv(N, ROWS),), (xc, gc, weight.contiguous(), y, N, float(eps)), K=K,
                   KP=next_pow2(K), ROWS=ROWS, num_warps=4)
    return y


def short_conv_update_ref(xs, states, weights):
    """The model's PyTorch path (cat, conv1d, SiLU), states updated in place."""
    out = []
    for x, s, w in zip(xs, states, weights):
        T, W = x.shape[1], w.shape[-1]
        full = torch.cat([s.to(x.dtype), x.transpose(1, 2)], dim=-1)
        y = F.conv1d(full.to(w.dtype), w, groups=w.shape[0])[..., -T:]
        out.append(F.silu(y).to(x.dtype).transpose(1, 2))
        s.copy_(full[..., -W:])
    return tuple(out)


def gated_rms_norm_ref(x, gate, weight, eps):
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)
