"""Kimi Delta Attention in plain PyTorch: the reference every fast kernel is tested against, and the CPU path.

Same signature as `kimi3_kernels.kda.{chunk_kda, fused_recurrent_kda}`:
  q, k [B,T,H,K]; v [B,T,H,V]; g the raw forget-gate pre-activation [B,T,H,K] (dt_bias not yet added);
  beta the raw logits [B,T,H]; A_log [H]; dt_bias [H*K]; states [N,H,K,V] float32 (key axis first).
The gate, sigmoid(beta), the q/k L2 norm and the scale all happen inside, in fp32, as in the kernels.

Recurrence per head (decay on the key axis):  S <- Diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;
o_t = S^T q_t.  The chunked form is the WY/UT transform of SPEC section 2, exact up to rounding.
"""

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def kda_gate(g, A_log, dt_bias, lower_bound=None):
    """Per-channel log-decay in fp32. K3: lower_bound * sigmoid(exp(A_log[h]) (f + dt_bias)) in (lower_bound, 0);
    Kimi Linear: -exp(A_log[h]) softplus(f + dt_bias)."""
    H, K = g.shape[-2], g.shape[-1]
    x = g.float() + dt_bias.float().view(H, K)
    a = A_log.float().exp().view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x)


def l2norm(x, eps=1e-6):
    # fla's form: eps inside the sqrt (not F.normalize's max(norm, eps))
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel):
    q, k, v = q.float(), k.float(), v.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, kda_gate(g, A_log, dt_bias, lower_bound), torch.sigmoid(beta.float())


def _per_sequence(fn, q, k, v, g, beta, initial_state, cu_seqlens, **kw):
    """Run a dense-batch function on each packed sequence of `cu_seqlens` (B must be 1)."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 packed row, got batch {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, ht = fn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=h0, **kw)
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1), torch.cat(states, 0)


def naive_recurrent_kda(q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                        inplace_final_state=False):
    """Token-by-token recurrence (decode and speculative verification)."""
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if cu_seqlens is not None:
        o, ht = _per_sequence(_recurrent, q, k, v, g, beta, initial_state, cu_seqlens, **kw)
    else:
        o, ht = _recurrent(q, k, v, g, beta, initial_state=initial_state, **kw)
    if inplace_final_state and initial_state is not None:
        initial_state.copy_(ht)
        ht = initial_state
    return o, (ht if output_final_state or inplace_final_state else None)


def _recurrent(q, k, v, g, beta, *, initial_state, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel):
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel)
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(out, 1) if out else v.new_zeros(B, 0, H, v.shape[-1])
    return o.to(dtype), S


def naive_chunk_kda(q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, scale=None, initial_state=None,
                    output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                    return_chunk_states=False, chunk_size=CHUNK_SIZE):
    """Chunked (WY/UT) form for prefill and training; differentiable through autograd."""
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    if return_chunk_states:
        raise NotImplementedError("return_chunk_states is provided by the Triton kernels only")
    if cu_seqlens is not None:
        o, ht = _per_sequence(_chunk, q, k, v, g, beta, initial_state, cu_seqlens, **kw)
    else:
        o, ht = _chunk(q, k, v, g, beta, initial_state=initial_state, **kw)
    return o, (ht if output_final_state else None)


def _chunk(q, k, v, g, beta, *, initial_state, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel,
           chunk_size):
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm_in_kernel)
    B, T, H, K = k.shape
    V = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, 0, H, V).to(dtype), (q.new_zeros(B, H, K, V) if initial_state is None
                                                   else initial_state.float())
    C = chunk_size
    pad = (-T) % C
    # padded positions: zero k/v/q, no decay (g=0) and beta=0, so they leave the state untouched
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C
    # [B,H,n,C,*]
    q, k, v, g = (x.view(B, n, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.view(B, n, C, H).permute(0, 3, 1, 2)
    G = g.cumsum(-2)
    # pairwise decay e^{G_i - G_j} per channel, only for j <= i (never overflows: exponent <= 0)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    strict = causal.clone().fill_diagonal_(False)
    L = torch.einsum("bhncd,bhnsd,bhncsd->bhncs", k, k, diff) * beta[..., None]
    L = L.masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + L, torch.diag_embed(beta), upper=False, unitriangular=True)
    W = Tm @ (k * G.exp())
    U = Tm @ v
    A_qk = torch.einsum("bhncd,bhnsd,bhncsd->bhncs", q, k, diff)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    out = []
    for i in range(n):
        v_new = U[:, :, i] - W[:, :, i] @ S
        out.append((q[:, :, i] * G[:, :, i].exp()) @ S + A_qk[:, :, i] @ v_new)
        G_end = G[:, :, i, -1:]  # [B,H,1,K]
        S = S * G_end.transpose(-1, -2).exp() + (k[:, :, i] * (G_end - G[:, :, i]).exp()).transpose(-1, -2) @ v_new
    o = torch.stack(out, 2).permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(dtype), S


def state_vk_to_kv(state):
    """The official K3 code keeps states [N,H,V,K] (`transpose_state_layout`); we keep [N,H,K,V]."""
    return state.transpose(-1, -2).contiguous()
