"""Routed-expert compute paths agree: index-sorted segments (CPU), gathered weights (small batches) and
torch._grouped_mm (the CUDA bf16 path, which also runs on CPU), against a plain per-token loop."""

import torch

from kimi3_testing import tiny_k3_text_config
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
        grouped = (eb._grouped_mm(x.bfloat16(), idx).float().view(50, 2, -1) * w[..., None]).sum(1)
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


def test_decode_gemv_is_chosen_only_where_it_applies(monkeypatch):
    # which calls take the per-route GEMV (kimi3_kernels/moe_decode.py; its numerics are tested under the Triton
    # interpreter in kernels_kda_cases.py): few routes, SiLU experts, no autograd, plain (non-DTensor) weights
    import pytest

    from transformers_kimi3 import moe

    if moe.gemv_max_routes() is None:
        pytest.skip("kimi3_kernels / triton not importable")
    monkeypatch.setattr(Kimi3Experts, "_gemv_on_cpu", True)
    monkeypatch.setenv("KIMI3_MOE_GEMV_MAX_ROUTES", "8")
    silu = Kimi3Experts(tiny_k3_text_config(hidden_act="silu", num_experts=8, moe_intermediate_size=32), 32)
    situ = Kimi3Experts(tiny_k3_text_config(num_experts=8, moe_intermediate_size=32), 32)
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert silu._use_gemv(x, 8) and not silu._use_gemv(x, 9)  # the route limit
        assert not situ._use_gemv(x, 8)  # SiTU stays on the PyTorch path
        silu.w1.device_mesh = object()  # a DTensor parameter (tensor parallelism)
        assert not silu._use_gemv(x, 8)
        del silu.w1.device_mesh
    assert not silu._use_gemv(x, 8)  # autograd recording and the weights need gradients: training path
    monkeypatch.setenv("KIMI3_MOE_GEMV_MAX_ROUTES", "0")
    with torch.no_grad():
        assert not silu._use_gemv(x, 1)


def test_decode_router_is_chosen_only_where_it_applies(monkeypatch):
    import pytest

    from transformers_kimi3 import moe

    if moe.gemv_max_routes() is None:
        pytest.skip("kimi3_kernels / triton not importable")
    monkeypatch.setattr(Kimi3TopkRouter, "_fused_on_cpu", True)
    monkeypatch.setenv("KIMI3_MOE_GEMV_MAX_ROUTES", "8")
    plain = Kimi3TopkRouter(tiny_k3_text_config(num_experts=8, num_experts_per_token=2))
    grouped = Kimi3TopkRouter(tiny_k3_text_config(num_experts=8, num_experts_per_token=2, num_expert_group=2,
                                                  topk_group=1))
    with torch.no_grad():
        assert plain._fused(torch.randn(4, 64)) and not plain._fused(torch.randn(5, 64))  # routes <= the limit
        assert not grouped._fused(torch.randn(1, 64))  # expert groups: the PyTorch path
    assert not plain._fused(torch.randn(1, 64))  # autograd recording (training)
