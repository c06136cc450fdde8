"""PackedMXFP4Experts on its exact paths (CPU): forward and gradients equal dequantise-then-matmul; fp32 activations
never reach the MXFP4 kernels (their operands are bf16)."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "src", ROOT / "kernels"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from transformers_kimi3 import kernels, mxfp4_experts  # noqa: E402
from transformers_kimi3.activations import GLUActivation  # noqa: E402
from transformers_kimi3.mxfp4 import dequantize_mxfp4, quantize_mxfp4, weight_memory_bytes  # noqa: E402
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts  # noqa: E402

E, D, I, T, K = 6, 64, 96, 9, 3


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make(glu_act=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, I, D, generator=g) * 0.1
    w3 = torch.randn(E, I, D, generator=g) * 0.1
    w2 = torch.randn(E, D, I, generator=g) * 0.1
    return PackedMXFP4Experts.from_float(w1, w3, w2, glu_act)


def routing(seed=1, t=T, k=K, e=E):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return idx, w / w.sum(-1, keepdim=True)


def reference(mod, x, idx, w):
    """Dequantise-then-matmul with autograd: fp32 math, GLU output rounded to x's dtype as the module does."""
    d1, d3, d2 = mod.dequantize(torch.float32)
    xf = x.float()
    out = 0
    for j in range(idx.shape[1]):
        e = idx[:, j]
        g = torch.einsum("td,tid->ti", xf, d1[e])
        u = torch.einsum("td,tid->ti", xf, d3[e])
        h = mod.glu_act(g, u).float()
        h = h + (h.to(x.dtype).float() - h).detach()  # rounding to x's dtype, straight-through for the gradient
        out = out + w[:, j:j + 1].float() * torch.einsum("ti,tdi->td", h, d2[e])
    return out.to(x.dtype)


SILU, SITU = GLUActivation("silu"), GLUActivation("situ", 4.0, 25.0)


@pytest.mark.parametrize("act", [SILU, SITU, GLUActivation("situ", 4.0, None), lambda g, u: torch.relu(g) * u])
def test_forward_and_grads_fp32(act):
    mod = make(act)
    assert mod.kernel_path == "torch-per-expert"
    idx, w = routing()
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
    w = w.requires_grad_()
    y = mod(x, idx, w)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    r = reference(mod, x2, idx, w2)
    assert y.dtype == torch.float32 and y.shape == (T, D)
    assert rel(y, r) < 1e-5
    dy = torch.randn_like(r)
    y.backward(dy)
    r.backward(dy)
    assert rel(x.grad, x2.grad) < 1e-5
    assert rel(w.grad, w2.grad) < 1e-5
    assert all(b.grad is None and not b.requires_grad for b in mod.buffers())


def test_forward_and_grads_bf16():
    mod = make(SITU)
    idx, w = routing(seed=5)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(6)).bfloat16().requires_grad_()
    y = mod(x, idx, w)
    x2 = x.detach().clone().requires_grad_()
    r = reference(mod, x2, idx, w)
    assert y.dtype == torch.bfloat16
    assert rel(y, r) < 4e-3  # both round the fp32 result to bf16 (2^-9 relative each)
    dy = torch.randn_like(r)
    y.backward(dy)
    r.backward(dy)
    assert rel(x.grad, x2.grad) < 4e-3


def test_top1_repeated_expert_and_unused_experts():
    mod = make()
    idx = torch.zeros(T, 1, dtype=torch.long)  # every token on expert 0, the others unused
    w = torch.ones(T, 1)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3))
    assert rel(mod(x, idx, w), reference(mod, x, idx, w)) < 1e-5
    assert mod(x[:0], idx[:0], w[:0]).shape == (0, D)


def test_dequantises_one_expert_at_a_time(monkeypatch):
    mod = make()
    shapes = []
    real = mxfp4_experts.decode_mxfp4

    def spy(packed, scale, dtype=torch.float32):
        shapes.append(tuple(packed.shape))
        return real(packed, scale, dtype)

    monkeypatch.setattr(mxfp4_experts, "decode_mxfp4", spy)
    idx, w = routing()
    x = torch.randn(T, D, requires_grad=True)
    mod(x, idx, w).sum().backward()
    assert shapes and all(len(s) == 2 for s in shapes), shapes  # never a stacked [E, ...] tensor


def test_buffers_are_the_checkpoint_bytes():
    g = torch.Generator().manual_seed(7)
    w1, w3 = torch.randn(E, I, D, generator=g), torch.randn(E, I, D, generator=g)
    w2 = torch.randn(E, D, I, generator=g)
    mod = PackedMXFP4Experts.from_float(w1, w3, w2)
    sd = mod.state_dict()
    assert set(sd) == {f"{n}_{k}" for n in ("w1", "w3", "w2") for k in ("packed", "scale")}
    assert sd["w1_packed"].shape == (E, I, D // 2) and sd["w1_scale"].shape == (E, I, D // 32)
    assert sd["w2_packed"].shape == (E, D, I // 2) and sd["w2_scale"].shape == (E, D, I // 32)
    for e in (0, E - 1):
        p, s = quantize_mxfp4(w2[e])
        assert torch.equal(sd["w2_packed"][e], p) and torch.equal(sd["w2_scale"][e], s)
    d1, d3, d2 = mod.dequantize(torch.bfloat16)
    assert d1.dtype == torch.bfloat16 and d2.shape == (E, D, I)
    assert torch.equal(d3, dequantize_mxfp4(sd["w3_packed"], sd["w3_scale"]))
    assert mod.weight_bytes == weight_memory_bytes(E, D, I)
    assert mod.weight_bytes <= 0.3 * weight_memory_bytes(E, D, I, torch.bfloat16)
    fresh = PackedMXFP4Experts(E, D, I)
    fresh.load_state_dict(sd)
    x = torch.randn(T, D)
    idx, w = routing()
    assert torch.equal(fresh(x, idx, w), mod(x, idx, w))


def test_corrupt_state_dict_refused_by_name():
    mod = make()
    sd = {k: v.clone() for k, v in mod.state_dict().items()}
    sd["w3_scale"][2, 5, 1] = 0xFF
    fresh = PackedMXFP4Experts(E, D, I)
    with pytest.raises(ValueError, match=r"layers\.4\.experts\.w3_packed.*0xFF"):
        nn.ModuleDict({"layers": nn.ModuleList([nn.Identity()] * 4 + [nn.ModuleDict({"experts": fresh})])}) \
            .load_state_dict({f"layers.4.experts.{k}": v for k, v in sd.items()})
    sd = {k: v.clone() for k, v in mod.state_dict().items()}
    sd["w1_packed"] = sd["w1_packed"].float()
    with pytest.raises(ValueError, match="w1_packed.*uint8"):
        fresh.load_state_dict(sd)
    with pytest.raises(ValueError, match="outside"):
        mod(torch.randn(2, D), torch.tensor([[0, E]]).expand(2, 2), torch.ones(2, 2))


def test_from_experts_module_and_fused_glu():
    """The fused kernels take the GLU from a GLUActivation's spec; any other callable runs unfused in PyTorch."""
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(8)
            self.w1 = nn.Parameter(torch.randn(E, I, D, generator=g))
            self.w3 = nn.Parameter(torch.randn(E, I, D, generator=g))
            self.w2 = nn.Parameter(torch.randn(E, D, I, generator=g))
            self.act_fn = GLUActivation("situ", 4.0, 25.0)

    dense = Experts()
    mod = PackedMXFP4Experts.from_experts(dense)
    assert mod._fused == ("situ", 4.0, 25.0) and mod.glu_act is dense.act_fn
    assert torch.equal(mod.w1_packed, quantize_mxfp4(dense.w1.detach())[0])
    assert make()._fused == ("silu", None, None) == GLUActivation("swish").spec
    assert GLUActivation("situ", 4.0, None).spec == ("situ", 4.0, None)
    assert make(lambda g, u: g * u)._fused is None
    with pytest.raises(ValueError, match="activation_situ_beta"):
        GLUActivation("situ")
    with pytest.raises(ValueError, match="unknown"):
        GLUActivation("gelu")


def test_kernel_status_reports_path():
    st = kernels.kernel_status("cpu")["moe"]
    assert st["mxfp4_experts"] == make().kernel_path == "torch-per-expert"


class _KernelsReached(Exception):
    pass


class _FakeMXFP4Ops:
    """Stands in for kimi3_kernels.mxfp4 on the CPU: available everywhere, and any kernel call is recorded by
    raising _KernelsReached."""
    HAS_TRITON = True

    def available(self, device):
        return True

    def __getattr__(self, name):
        def kernel(*a, **kw):
            raise _KernelsReached(name)
        return kernel


@pytest.fixture
def fake_kernel_device(monkeypatch):
    """A kernel device (as CUDA would be) with the fake MXFP4 kernels and no decode kernels (the GLU runs in
    PyTorch)."""
    monkeypatch.setattr(kernels, "kernel_device", lambda t: True)
    monkeypatch.setattr(kernels, "mxfp4_ops", lambda: _FakeMXFP4Ops())
    monkeypatch.setattr(kernels, "moe_ops", None)


@pytest.mark.parametrize("T_", [T, 40])
@pytest.mark.parametrize("grad", [False, True])
def test_fp32_never_reaches_the_bf16_kernels(fake_kernel_device, T_, grad):
    """Issue 52: an fp32 model on the GPU computes its experts in fp32 (the packed GEMM's operands are bf16). On a
    kernel device fp32 activations take the exact paths (without autograd and up to GATHER_MAX_ROUTES routes the
    gathered one, which has no host synchronisation; else the sorted one), equal to the CPU's to 1e-6; bf16
    activations reach the kernels."""
    mod = make(SITU)
    idx, w = routing(seed=4, t=T_)
    x = torch.randn(T_, D, generator=torch.Generator().manual_seed(9))
    gathered = []
    real = PackedMXFP4Experts._forward_gathered
    mod._forward_gathered = lambda *a: gathered.append(1) or real(mod, *a)
    with torch.set_grad_enabled(grad):
        y = mod(x.clone().requires_grad_(grad), idx, w)
    assert gathered == ([1] if not grad and T_ * K <= mod.GATHER_MAX_ROUTES else [])
    with pytest.raises(_KernelsReached):
        with torch.set_grad_enabled(grad):
            mod(x.bfloat16().requires_grad_(grad), idx, w)
    with pytest.MonkeyPatch.context() as mp:  # the CPU as it is: no kernel device
        mp.setattr(kernels, "kernel_device", lambda t: False)
        ref = mod(x, idx, w)
    assert rel(y, ref) < 1e-6


def test_gathered_path_chunks_and_checks(fake_kernel_device):
    """The gathered path in chunks of decoded weights equals one chunk and the sorted path; bad ids are refused."""
    mod = make(SITU)
    idx, w = routing(seed=6)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(10)).bfloat16()
    with torch.no_grad():
        one = mod._forward_gathered(x.float(), idx, w)
        mod.GATHER_CHUNK_BYTES = 5 * 3 * I * D * 4  # 5 routes per chunk
        chunked = mod._forward_gathered(x.float(), idx, w)
        assert torch.equal(one, chunked)
        assert rel(mod._forward_gathered(x, idx, w), reference(mod, x, idx, w)) < 4e-3  # bf16 h and y, as the module
        with pytest.raises(ValueError, match="outside"):
            mod._forward_gathered(x.float(), torch.full_like(idx, E), w)


def test_adapter_training_step_on_frozen_base():
    """A LoRA-style adapter in front of frozen packed experts receives gradients; the packed bytes never change."""
    mod = make(SITU)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    adapter = nn.Linear(D, D)
    opt = torch.optim.SGD(adapter.parameters(), lr=0.1)
    idx, w = routing()
    x = torch.randn(T, D)
    losses = []
    for _ in range(3):
        y = mod(adapter(x), idx, w)
        loss = (y - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert adapter.weight.grad is not None and adapter.weight.grad.abs().sum() > 0
    assert losses[-1] < losses[0]
    assert all(torch.equal(v, before[k]) for k, v in mod.state_dict().items())
