"""The PyTorch KDA reference: chunked vs recurrent vs an independent fp64 step-by-step recurrence."""

import pytest
import torch

from kimi3_kernels.kda.reference import naive_chunk_kda, naive_recurrent_kda

# fp32 reference vs fp64 recurrence: rounding only (inputs O(1), T <= 150)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def fp64_recurrence(q, k, v, g, beta, A_log, dt_bias, lower_bound, h0):
    """Written from SPEC section 2, independently of the module under test."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    x = g + dt_bias.double().view(H, K)
    a = A_log.double().exp().view(H, 1)
    gate = lower_bound * torch.sigmoid(a * x) if lower_bound is not None else -a * torch.nn.functional.softplus(x)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * K ** -0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    b = torch.sigmoid(beta)
    S = h0.double().clone() if h0 is not None else torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            for n in range(B):
                Sn = torch.diag(gate[n, t, h].exp()) @ S[n, h]
                kt = k[n, t, h]
                Sn = Sn + b[n, t, h] * torch.outer(kt, v[n, t, h] - Sn.T @ kt)
                S[n, h] = Sn
                out[n, t, h] = Sn.T @ q[n, t, h]
    return out, S


def inputs(B, T, H, K, V, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, H, V).to(dtype),
                g=r(B, T, H, K).to(dtype), beta=r(B, T, H).to(dtype), A_log=r(H) * 0.5, dt_bias=r(H * K),
                h0=r(B, H, K, V))


@pytest.mark.parametrize("T", [1, 37, 64, 130])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunk_and_recurrent_match_fp64(T, lower_bound):
    x = inputs(2, T, 2, 16, 8)
    ref_o, ref_s = fp64_recurrence(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                   lower_bound, x["h0"])
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lower_bound, initial_state=x["h0"],
              output_final_state=True)
    for fn in (naive_chunk_kda, naive_recurrent_kda):
        o, s = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        assert (o.double() - ref_o).abs().max() < TOL[torch.float32], fn.__name__
        assert (s.double() - ref_s).abs().max() < TOL[torch.float32], fn.__name__


def test_bf16_inputs_keep_fp32_state():
    x = inputs(1, 70, 2, 16, 16, dtype=torch.bfloat16)
    o, s = naive_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                           lower_bound=-5.0, output_final_state=True)
    ref_o, ref_s = fp64_recurrence(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], -5.0, None)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert (o.double() - ref_o).abs().max() < TOL[torch.bfloat16]
    assert (s.double() - ref_s).abs().max() < 1e-4  # state accumulates in fp32 from bf16-rounded inputs


def test_varlen_equals_separate_sequences():
    lengths = [5, 0, 1, 70]
    x = inputs(1, sum(lengths), 2, 16, 8)
    cu = torch.tensor([0, 5, 5, 6, 76])
    h0 = torch.randn(len(lengths), 2, 16, 8)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, output_final_state=True)
    o, s = naive_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, initial_state=h0, **kw)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        ref_o, ref_s = fp64_recurrence(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["g"][:, sl],
                                       x["beta"][:, sl], x["A_log"], x["dt_bias"], -5.0, h0[n:n + 1])
        if b > a:
            assert (o[:, sl].double() - ref_o).abs().max() < TOL[torch.float32]
        assert (s[n:n + 1].double() - ref_s).abs().max() < TOL[torch.float32]


def test_chunk_gradients_match_recurrent():
    x = inputs(1, 40, 2, 16, 8, seed=3)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    grads = []
    for fn in (naive_chunk_kda, naive_recurrent_kda):
        o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=leaves["A_log"],
                  dt_bias=leaves["dt_bias"], lower_bound=-5.0, initial_state=leaves["h0"], output_final_state=True)
        loss = (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + s.square().sum()
        grads.append(torch.autograd.grad(loss, list(leaves.values())))
    for name, a, b in zip(leaves, *grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3), name


@pytest.mark.parametrize("B,T,D,W", [(2, 7, 12, 4), (1, 1, 8, 4), (3, 2, 5, 3)])
def test_causal_conv_is_the_depthwise_conv(B, T, D, W):
    """The layer's causal conv (explicit taps summed in fp32, no cuDNN) against F.conv1d in fp64, with and without a
    state: fp32 rounding only, and the new state is the last W inputs."""
    import torch.nn.functional as F

    from transformers_kimi3.kda import causal_conv

    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, D, generator=gen)
    w = torch.randn(D, 1, W, generator=gen)
    for state in (None, torch.randn(B, D, W, generator=gen)):
        y, new_state = causal_conv(x, w, state)
        prev = x.new_zeros(B, D, W) if state is None else state
        full = torch.cat([prev, x.transpose(1, 2)], -1)
        ref = F.silu(F.conv1d(full.double(), w.double(), groups=D)[..., -T:]).transpose(1, 2)
        assert y.dtype == torch.float32 and (y.double() - ref).abs().max() < 1e-6 * ref.abs().max()
        assert torch.equal(new_state, full[..., -W:])
