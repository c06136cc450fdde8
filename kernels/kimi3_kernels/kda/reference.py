"""Readable PyTorch references for Kimi Delta Attention (KDA).

Every function here has the same signature as its Triton counterpart in this package, runs on any
device, computes in fp32 and is differentiable through plain autograd. They are the ground truth
for the tests and the fallback when Triton is not available.

Conventions (see docs/kernels.md):
  q, k: [B, T, H, K]; v: [B, T, H, V]; g: raw forget-gate pre-activation [B, T, H, K] (dt_bias not added);
  beta: raw logits [B, T, H]; A_log: [H] fp32; dt_bias: [H*K] fp32.
  State layout: [N, H, K, V] fp32 (K first). The official K3 code stores [V, K]: use
  `state_kv_to_vk` / `state_vk_to_kv` at the boundary.
  With cu_seqlens ([N+1] offsets), B must be 1 and sequences are packed along T.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def state_kv_to_vk(state: torch.Tensor) -> torch.Tensor:
    """[N, H, K, V] (this package) -> [N, H, V, K] (official K3 / fla `state_v_first` layout)."""
    return state.transpose(-1, -2).contiguous()


def state_vk_to_kv(state: torch.Tensor) -> torch.Tensor:
    """[N, H, V, K] (official K3 layout) -> [N, H, K, V] (this package)."""
    return state.transpose(-1, -2).contiguous()


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None) -> torch.Tensor:
    """Log-decay from the raw gate pre-activation, in fp32.

    lower_bound given (K3):  g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))
    otherwise (Kimi Linear): g = -exp(A_log[h]) * softplus(f + dt_bias)
    """
    H, K = g.shape[-2], g.shape[-1]
    x = g.float() + dt_bias.float().view(H, K)
    a = A_log.float()[:H].exp().view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel):
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q.float() * scale
    k = k.float()
    gg = kda_gate(g, A_log, dt_bias, lower_bound)
    b = torch.sigmoid(beta.float())
    return q, k, v.float(), gg, b


def _seq_bounds(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    assert B == 1, "cu_seqlens requires B == 1 (sequences packed along T)"
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _init_state(initial_state, n, H, K, V, device):
    if initial_state is None:
        return torch.zeros(H, K, V, device=device, dtype=torch.float32)
    return initial_state[n].float()


def naive_recurrent_kda(q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, scale=None,
                        initial_state=None, output_final_state=False, cu_seqlens=None,
                        use_qk_l2norm_in_kernel=True, inplace_final_state=False):
    """Token-by-token recurrence (reference for `fused_recurrent_kda`).

    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel)
    o = torch.zeros(B, T, H, V, device=q.device, dtype=torch.float32)
    finals = []
    for n, (b, s, e) in enumerate(_seq_bounds(B, T, cu_seqlens)):
        S = _init_state(initial_state, n, H, K, V, q.device)
        outs = []
        for t in range(s, e):
            S = S * gf[b, t].exp()[..., None]
            kt = kf[b, t]
            pred = torch.einsum("hk,hkv->hv", kt, S)
            S = S + torch.einsum("hk,hv->hkv", kt, bf[b, t][:, None] * (vf[b, t] - pred))
            outs.append(torch.einsum("hk,hkv->hv", qf[b, t], S))
        if outs:
            o = _place(o, b, s, e, torch.stack(outs))
        finals.append(S)
    final = torch.stack(finals) if finals else None
    if inplace_final_state and initial_state is not None:
        with torch.no_grad():
            initial_state.copy_(final)
        final = initial_state
    return o.to(q.dtype), (final if (output_final_state or inplace_final_state) else None)


def _place(o, b, s, e, x):
    # out-of-place write keeps autograd simple
    pad_top = o[b, :s]
    pad_bot = o[b, e:]
    row = torch.cat([pad_top, x, pad_bot], 0)
    return torch.cat([o[:b], row[None], o[b + 1:]], 0)


def _chunk_one(q, k, v, g, b, S, C, want_states):
    """Chunked WY/UT form for one sequence. q,k,g: [L, H, K]; v: [L, H, V]; b: [L, H]; S: [H, K, V]."""
    L, H, K = q.shape
    V = v.shape[-1]
    NT = (L + C - 1) // C
    pad = NT * C - L
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        b = F.pad(b, (0, 0, 0, pad))
    # [H, NT, C, .]
    q, k, v, g = (x.view(NT, C, H, -1).permute(2, 0, 1, 3) for x in (q, k, v, g))
    b = b.view(NT, C, H).permute(2, 0, 1)
    G = g.cumsum(-2)                                   # chunk-local cumulative log decay
    # pairwise decayed products with a per-pair exponent (no overflow: only j <= i is used)
    diff = G[..., :, None, :] - G[..., None, :, :]     # [H, NT, C(i), C(j), K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    E = torch.where(causal[..., None], diff, torch.full_like(diff, -float("inf"))).exp()
    Akk = torch.einsum("hnik,hnjk,hnijk->hnij", k, k, E) * b[..., None]
    Akk = Akk.masked_fill(~strict, 0)
    Aqk = torch.einsum("hnik,hnjk,hnijk->hnij", q, k, E).masked_fill(~causal, 0)
    eye = torch.eye(C, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False, unitriangular=True) * b[..., None, :]
    W = Tm @ (k * G.exp())
    U = Tm @ v
    states = []
    o = []
    for n in range(NT):
        if want_states:
            states.append(S)
        vn = U[:, n] - W[:, n] @ S
        o.append((q[:, n] * G[:, n].exp()) @ S + Aqk[:, n] @ vn)
        gl = G[:, n, -1]                               # last row (padded rows carry zero k, v)
        S = S * gl.exp()[..., None] + ((gl[:, None] - G[:, n]).exp() * k[:, n]).transpose(-1, -2) @ vn
    o = torch.stack(o, 1).permute(1, 2, 0, 3).reshape(NT * C, H, V)[:L]
    return o, S, states


def naive_chunk_kda(q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, scale=None,
                    initial_state=None, output_final_state=False, cu_seqlens=None,
                    use_qk_l2norm_in_kernel=True, return_chunk_states=False):
    """Chunked (C=64) WY/UT form in PyTorch (reference for `chunk_kda`).

    Padded rows of a partial last chunk carry k = v = 0, so the state update ignores them; the
    last-row decay of a partial chunk is taken at the last real token.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = CHUNK_SIZE
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel)
    o = torch.zeros(B, T, H, V, device=q.device, dtype=torch.float32)
    finals, all_states = [], []
    for n, (b, s, e) in enumerate(_seq_bounds(B, T, cu_seqlens)):
        S = _init_state(initial_state, n, H, K, V, q.device)
        if e > s:
            gl = gf[b, s:e]
            L = e - s
            pad = (-L) % C
            if pad:  # zero decay on padded rows keeps the last-row decay equal to the last real token's
                gl = F.pad(gl, (0, 0, 0, 0, 0, pad))
            ob, S, st = _chunk_one(
                F.pad(qf[b, s:e], (0, 0, 0, 0, 0, pad)), F.pad(kf[b, s:e], (0, 0, 0, 0, 0, pad)),
                F.pad(vf[b, s:e], (0, 0, 0, 0, 0, pad)), gl, F.pad(bf[b, s:e], (0, 0, 0, pad)), S, C,
                return_chunk_states)
            o = _place(o, b, s, e, ob[:L])
            all_states += st
        finals.append(S)
    final = torch.stack(finals) if (output_final_state and finals) else None
    o = o.to(q.dtype)
    if return_chunk_states:
        cs = torch.stack(all_states) if all_states else q.new_zeros(0, H, K, V, dtype=torch.float32)
        return o, final, cs
    return o, final
