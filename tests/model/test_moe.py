"""Routed-expert compute paths agree: index-sorted segments (CPU), gathered weights (small batches) and
torch._grouped_mm (the CUDA bf16 path, which also runs on CPU), against a plain per-token loop."""

import torch

from kimi3_testing import tiny_k3_text_config
from transformers_kimi3 import moe
from transformers_kimi3.moe import Kimi3Experts, Kimi3TopkRouter


def experts_and_inputs(T, seed=0):
    torch.manual_seed(seed)
    e = Kimi3Experts(tiny_k3_text_config(num_experts=8, moe_intermediate_size=32), 32)
    for w in (e.w1, e.w2, e.w3):
        torch.nn.init.normal_(w, 0, 0.2)
    x = torch.randn(T, 32)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(T)])
    return e, x, idx, torch.rand(T, 2)


def per_token(e, x, idx, w):
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            n = int(idx[t, k])
            h = e.act_fn((e.w1[n] @ x[t])[None], (e.w3[n] @ x[t])[None])[0]
            out[t] += w[t, k].double() * (e.w2[n] @ h).double()
    return out


def test_segments_gathered_and_grouped_mm_agree():
    e, x, idx, w = experts_and_inputs(50)
    with torch.no_grad():
        ref = per_token(e, x, idx, w)
        segments = e(x, idx, w)  # 100 assignments: the sorted-segment path
        gathered = (e._gathered(x, idx).view(50, 2, -1) * w[..., None]).sum(1)
        eb = e.to(torch.bfloat16)
        grouped = (eb._unsort(*eb._grouped_mm(x.bfloat16(), idx)).float().view(50, 2, -1) * w[..., None]).sum(1)
    scale = ref.abs().max()
    assert (segments.double() - ref).abs().max() / scale < 1e-5
    assert (gathered.double() - ref).abs().max() / scale < 1e-5
    assert (grouped.double() - ref).abs().max() / scale < 2e-2  # bf16 weights and activations


def test_router_uses_bias_for_selection_only():
    cfg = tiny_k3_text_config(num_experts=8, num_experts_per_token=2)
    r = Kimi3TopkRouter(cfg)
    torch.nn.init.normal_(r.weight, 0, 0.5)
    x = torch.randn(20, cfg.hidden_size)
    r.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
    logits, w, idx = r(x)
    scores = torch.sigmoid(x @ r.weight.T)
    expected_idx = (scores + r.e_score_correction_bias).topk(2, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, expected_idx.sort(-1).values)
    picked = scores.gather(1, idx)
    assert torch.allclose(w, picked / (picked.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor)


def _recorded(monkeypatch, name, result):
    """Replace kimi3_kernels.moe_decode.<name> (`kernels.moe_ops`) by a recorder (the kernels themselves run under
    the Triton interpreter in kernels_kda_cases.py) and let the model use it on CPU tensors (`kernels.kernel_device`
    is CUDA otherwise); returns the list of calls."""
    import pytest

    from transformers_kimi3 import kernels

    if kernels.moe_ops is None:
        pytest.skip("kimi3_kernels / triton not importable")
    calls = []
    monkeypatch.setattr(kernels, "kernel_device", lambda t: True)
    monkeypatch.setattr(kernels.moe_ops, name, lambda *a, **kw: calls.append(a) or result(*a))
    return calls


def test_decode_gemv_is_chosen_only_where_it_applies(monkeypatch):
    # few routes, SiLU experts, no autograd, plain (non-DTensor) weights
    calls = _recorded(monkeypatch, "expert_gemv", lambda x, *a: torch.zeros(x.shape[0], 32))
    _recorded(monkeypatch, "glu_mul", lambda g, u, b, lb: g * u)  # the other paths' GLU
    monkeypatch.setattr(moe, "GEMV_MAX_ROUTES", 8)
    silu = Kimi3Experts(tiny_k3_text_config(hidden_act="silu", num_experts=8, moe_intermediate_size=32), 32)
    situ = Kimi3Experts(tiny_k3_text_config(num_experts=8, moe_intermediate_size=32), 32)

    def used(experts, T, grad=False):
        calls.clear()
        with torch.set_grad_enabled(grad):
            experts(torch.randn(T, 32), torch.zeros(T, 2, dtype=torch.long), torch.rand(T, 2))
        return bool(calls)

    assert used(silu, 4) and not used(silu, 5)  # 8 routes at most
    assert not used(situ, 4)  # SiTU stays on the PyTorch path
    silu.w1.device_mesh = object()  # a DTensor parameter (tensor parallelism)
    assert not used(silu, 4)
    del silu.w1.device_mesh
    assert not used(silu, 4, grad=True)  # autograd recording and the weights need gradients: training path
    monkeypatch.setattr(moe, "GEMV_MAX_ROUTES", 0)
    assert not used(silu, 1)


def test_one_token_mlp_gemv_is_chosen_only_where_it_applies(monkeypatch):
    from transformers_kimi3.moe import Kimi3MLP

    calls = _recorded(monkeypatch, "mlp_gemv", lambda x, g, u, d: torch.zeros(1, d.shape[0]))
    _recorded(monkeypatch, "glu_mul", lambda g, u, b, lb: g)
    silu, situ = (Kimi3MLP(tiny_k3_text_config(hidden_act=a), 48) for a in ("silu", "situ"))

    def used(mlp, shape, grad=False):
        calls.clear()
        with torch.set_grad_enabled(grad):
            y = mlp(torch.randn(*shape, 64))
        assert y.shape == (*shape, 64)
        return bool(calls)

    assert used(silu, (1, 1)) and used(silu, (1,))  # one token, whatever the leading dims
    assert not used(silu, (2, 1)) and not used(silu, (1, 3))  # each row would re-read the weights
    assert not used(situ, (1, 1))  # SiTU stays on the PyTorch path
    assert not used(silu, (1, 1), grad=True)  # training
    monkeypatch.setattr(moe, "GEMV_MAX_ROUTES", 0)  # the decode kernels' route limit
    assert not used(silu, (1, 1))
    monkeypatch.setattr(moe, "GEMV_MAX_ROUTES", 64)
    monkeypatch.setenv("KIMI3_INFERENCE_KERNELS", "0")  # every inference kernel off
    assert not used(silu, (1, 1))


def test_decode_router_and_glu_kernels_are_chosen_only_where_they_apply(monkeypatch):
    from transformers_kimi3.moe import GLUActivation

    calls = _recorded(monkeypatch, "route_topk", lambda x, w, b, k, *a: (torch.zeros(x.shape[0], 8),
                                                                         torch.zeros(x.shape[0], k),
                                                                         torch.zeros(x.shape[0], k, dtype=torch.long)))
    monkeypatch.setattr(moe, "GEMV_MAX_ROUTES", 8)
    plain = Kimi3TopkRouter(tiny_k3_text_config(num_experts=8, num_experts_per_token=2))
    grouped = Kimi3TopkRouter(tiny_k3_text_config(num_experts=8, num_experts_per_token=2, num_expert_group=2,
                                                  topk_group=1))

    def used(router, T, grad=False):
        calls.clear()
        with torch.set_grad_enabled(grad):
            router(torch.randn(T, 64))
        return bool(calls)

    assert used(plain, 4) and not used(plain, 5)  # routes <= the limit
    assert not used(grouped, 1)  # expert groups: the PyTorch path
    assert not used(plain, 1, grad=True)  # autograd recording (training)
    glu_calls = _recorded(monkeypatch, "glu_mul", lambda g, u, b, lb: g)
    silu, situ = (GLUActivation.from_config(tiny_k3_text_config(hidden_act=a)) for a in ("silu", "situ"))
    g = torch.randn(3, 5)
    with torch.no_grad():
        silu(g, g), situ(g, g)
    silu(g, g.requires_grad_()), situ(g, g)  # autograd: the PyTorch path
    # SiLU without betas, SiTU with its two
    assert [c[2:] for c in glu_calls] == [(None, None), (situ.beta, situ.linear_beta)]
    monkeypatch.setenv("KIMI3_INFERENCE_KERNELS", "0")
    with torch.no_grad():
        silu(g, g), situ(g, g), plain(torch.randn(1, 64))
    assert len(glu_calls) == 2 and not used(plain, 1)


def test_grouped_mm_path_takes_float_weights_with_bf16_activations(monkeypatch):
    """Trainer's bf16=True: autocast hands bf16 activations to fp32 expert weights, and torch._grouped_mm is outside
    autocast. The path casts the weights as autocast casts a Linear's: the same values as bf16 weights, and the
    gradients reach the fp32 weights."""
    from transformers_kimi3 import kernels

    monkeypatch.setattr(kernels, "kernel_device", lambda t: True)  # the CUDA path, on CPU tensors
    cfg = tiny_k3_text_config(hidden_act="silu", num_experts=8, moe_intermediate_size=32)
    experts = Kimi3Experts(cfg, 32)
    g = torch.Generator().manual_seed(0)
    for w in experts.parameters():
        w.data = torch.randn(w.shape, generator=g) * 0.2
    bf16 = Kimi3Experts(cfg, 32).bfloat16()
    bf16.load_state_dict(experts.state_dict())
    x = torch.randn(40, 32, generator=g).bfloat16()
    idx, w = torch.randint(0, 8, (40, 2), generator=g), torch.rand(40, 2, generator=g)
    y = experts(x, idx, w)
    assert torch.equal(y, bf16(x, idx, w))
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
               for p in experts.parameters())
