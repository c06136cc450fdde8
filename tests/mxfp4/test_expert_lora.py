"""LoRA on the packed MXFP4 experts (`expert_lora`): the same logits and gradients as PEFT's own LoRA on the
dequantised experts (`target_parameters`), the PEFT adapter's save / load round trip, merging (requantised to MXFP4,
its error reported) and unmerging, and a few Trainer steps."""

import copy
import importlib.util

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kimi3_testing import MOE_MICRO, checkpointing_argument, rel_err, tiny_k3_text_config, tiny_model
from transformers_kimi3.expert_lora import (
    PackedExpertsLoraLayer,
    load_packed_experts_adapter,
    merge_errors,
    packed_experts_lora_config,
    packed_experts_lora_forward,
)
from transformers_kimi3.moe import Kimi3Experts, Kimi3SparseMoeBlock
from transformers_kimi3.mxfp4 import decode_mxfp4, quantize_mxfp4
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs PEFT")

# two MLA layers, both MoE; intermediate 64 != latent 32, so a transposed factor cannot pass
MICRO = dict(MOE_MICRO, moe_intermediate_size=64)
R, ALPHA = 4, 8
_CKPT_ARG = checkpointing_argument()


def _blocks(model):
    return [m for m in model.modules() if isinstance(m, Kimi3SparseMoeBlock)]


def packed_model(seed=0, fmt="bf16"):
    """The tiny model with its routed experts quantised to packed MXFP4 (as a packed checkpoint loads)."""
    from kimi3_conversion.quantize_job import MXFP4_QUANTIZATION_CONFIG

    model = tiny_model(seed, moe_activation_format=fmt, **MICRO)
    model.config.get_text_config().checkpoint_quantization_config = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    for block in _blocks(model):
        block.experts = PackedMXFP4Experts.from_experts(block.experts)
        block.experts.activation_format = fmt
    return model


def dequantised(packed):
    """The same model with float experts holding the packed experts' exact values."""
    model = copy.deepcopy(packed)
    config = model.config.get_text_config()
    config.checkpoint_quantization_config = None
    for block in _blocks(model):
        plain = Kimi3Experts(config, block.experts.hidden_size)
        for n, w in zip(("w1", "w3", "w2"), block.experts.dequantize(torch.float32)):
            setattr(plain, n, torch.nn.Parameter(w))
        block.experts = plain
    return model


def _ids(seed=0, T=12):
    return torch.randint(3, 96, (2, T), generator=torch.Generator().manual_seed(seed))


def _layers(model):
    return [m for m in model.modules() if isinstance(m, PackedExpertsLoraLayer)]


def _randomise_b(model, std=0.05, seed=0):
    """B ~ N(0, std) instead of zeros, so that the adapters change the outputs from the start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


class _Factors(torch.nn.Module):
    def __init__(self, **tensors):
        super().__init__()
        for n, t in tensors.items():
            setattr(self, n, torch.nn.Parameter(t))


def _module_case(E=4, D=32, I=64, T=24, k=2, r=R, device="cpu", seed=0):
    """Packed experts (K3's SiTU GLU), random rank-r factors, routes: (experts, A, B, x, topk_idx, topk_w)."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(E, *shape, generator=g) * 0.1 for shape in ((I, D), (I, D), (D, I))]
    act = Kimi3Experts(tiny_k3_text_config(num_experts=E, moe_intermediate_size=I), D).act_fn
    experts = PackedMXFP4Experts.from_float(*w, glu_act=act).to(device)
    dims = {"w1": (D, I), "w3": (D, I), "w2": (I, D)}
    A = _Factors(**{n: torch.randn(E, r, i, generator=g) * 0.2 for n, (i, _) in dims.items()}).to(device)
    B = _Factors(**{n: torch.randn(E, o, r, generator=g) * 0.2 for n, (_, o) in dims.items()}).to(device)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    return experts, A, B, torch.randn(T, D, generator=g).to(device), idx, torch.rand(T, k, generator=g).to(device)


def test_routed_lora_equals_float_experts_with_the_update_added():
    """`packed_experts_lora_forward` against `Kimi3Experts`' routed path on W + s B A (decoded W), fp32: outputs and
    the gradients with respect to the activations, the routing weights and every factor to 1e-5."""
    experts, A, B, x, idx, tw = _module_case()
    s = ALPHA / R
    x.requires_grad_()
    tw.requires_grad_()
    y = packed_experts_lora_forward(experts, x, idx, tw, [(A, B, s, torch.nn.Identity())])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(y, [x, tw, *A.parameters(), *B.parameters()], dy)

    ref_A, ref_B = copy.deepcopy(A), copy.deepcopy(B)
    x2, tw2 = x.detach().clone().requires_grad_(), tw.detach().clone().requires_grad_()
    plain = Kimi3Experts(tiny_k3_text_config(num_experts=4, moe_intermediate_size=64), 32)
    weights = tuple(w + s * torch.bmm(getattr(ref_B, n), getattr(ref_A, n))
                    for n, w in zip(("w1", "w3", "w2"), experts.dequantize(torch.float32)))
    y_ref = (plain._segments(x2, idx, weights).view(*idx.shape, -1) * tw2[..., None]).sum(1)
    want = torch.autograd.grad(y_ref, [x2, tw2, *ref_A.parameters(), *ref_B.parameters()], dy)
    assert rel_err(y.detach(), y_ref.detach()) < 1e-5
    for a, b in zip(got, want):
        assert a.abs().sum() > 0 and rel_err(a, b) < 1e-5


@needs_peft
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_lora_on_packed_experts_equals_lora_on_dequantised_experts(fmt):
    """Packed experts + `PackedExpertsLoraLayer` against float experts holding the same values + PEFT's ParamWrapper
    (`target_parameters`) with the same factors: same logits, same gradients of every adapter factor (the experts'
    and the latent down projection's, whose gradient passes through the packed experts' backward) to 1e-5 in fp32.
    Without an update (B = 0) the packed LoRA path is the packed experts' own forward, bit for bit."""
    from peft import LoraConfig, get_peft_model

    base = packed_model(fmt=fmt)
    reference = dequantised(base)
    with torch.no_grad():
        plain = base(input_ids=_ids()).logits
    lora = get_peft_model(base, packed_experts_lora_config(r=R, lora_alpha=ALPHA,
                                                           target_modules=["experts", "routed_expert_down_proj"]))
    with torch.no_grad():
        assert torch.equal(lora(input_ids=_ids()).logits, plain)  # B = 0
    _randomise_b(lora)
    ref = get_peft_model(reference, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["routed_expert_down_proj"],
                                               target_parameters=["experts.w1", "experts.w3", "experts.w2"]))
    # the same factors in ParamWrapper's layout: lora_A [E*r, in] expert-major, lora_B [out, r*E] rank-major
    wrappers = {}
    for name, m in ref.named_modules():
        if type(m).__name__ == "ParamWrapper":
            wrappers[(name.split(".block_sparse_moe")[0], m.parameter_name)] = m
    pairs = []
    with torch.no_grad():
        for name, layer in lora.named_modules():
            if not isinstance(layer, PackedExpertsLoraLayer):
                continue
            key = name.split(".block_sparse_moe")[0]
            for n in ("w1", "w3", "w2"):
                A, B = getattr(layer.lora_A["default"], n), getattr(layer.lora_B["default"], n)
                E, out, r = B.shape
                w = wrappers[(key, n)]
                w.lora_A["default"].weight.copy_(A.reshape(E * r, -1))
                w.lora_B["default"].weight.copy_(B.permute(1, 2, 0).reshape(out, r * E))
                pairs.append((A, B, w))
        own = dict(lora.named_parameters())
        for n, p in ref.named_parameters():
            if "routed_expert_down_proj.lora_" in n:
                p.copy_(own[n])
    assert len(pairs) == 6

    out, out_ref = lora(input_ids=_ids(), labels=_ids()), ref(input_ids=_ids(), labels=_ids())
    assert rel_err(out.logits.detach(), plain) > 1e-3  # the adapters act
    assert rel_err(out.logits.detach(), out_ref.logits.detach()) < 1e-5
    out.loss.backward()
    out_ref.loss.backward()
    for A, B, w in pairs:
        E, out_f, r = B.shape
        assert A.grad.abs().sum() > 0 and B.grad.abs().sum() > 0
        assert rel_err(A.grad.reshape(E * r, -1), w.lora_A["default"].weight.grad) < 1e-5
        assert rel_err(B.grad.permute(1, 2, 0).reshape(out_f, r * E), w.lora_B["default"].weight.grad) < 1e-5
    ref_grads = dict(ref.named_parameters())
    latent = [n for n, p in lora.named_parameters() if "routed_expert_down_proj.lora_" in n]
    assert len(latent) == 4
    for n in latent:
        assert rel_err(own[n].grad, ref_grads[n].grad) < 1e-5, n


@needs_peft
def test_adapter_save_load_merge_and_unmerge(tmp_path):
    """A normal PEFT adapter: `save_pretrained` writes the factors, `load_packed_experts_adapter` on a fresh packed
    model gives identical logits. Merging requantises s B A + W with `quantize_mxfp4` (the QAT rounding), reports the
    error exactly, and unmerging restores the packed bytes; the merged model saves and reloads as a packed model."""
    from peft import get_peft_model

    lora = get_peft_model(packed_model(), packed_experts_lora_config(r=R, lora_alpha=ALPHA,
                                                                     target_modules=["experts", "q_b_proj"]))
    _randomise_b(lora, std=0.5)
    lora.eval()
    with torch.no_grad():
        want = lora(input_ids=_ids(3)).logits
    lora.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.block_sparse_moe.experts.lora_B.w2" in saved
    assert saved["base_model.model.model.layers.0.block_sparse_moe.experts.lora_A.w2"].shape == (8, R, 64)

    fresh = packed_model()
    packed_before = [{k: v.clone() for k, v in b.experts.state_dict().items()} for b in _blocks(fresh)]
    loaded = load_packed_experts_adapter(fresh, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_ids(3)).logits, want)

    # merge then unmerge: the packed bytes come back (q_b_proj's float weight only to rounding)
    loaded.merge_adapter()
    assert all(layer.merged for layer in _layers(loaded))
    assert not torch.equal(_blocks(loaded)[0].experts.get_base_layer().w1_packed, packed_before[0]["w1_packed"])
    loaded.unmerge_adapter()
    for block, before in zip(_blocks(loaded), packed_before):
        after = block.experts.get_base_layer().state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        assert rel_err(loaded(input_ids=_ids(3)).logits, want) < 1e-6

    # the expected merged weights, computed here from the factors
    expected = []
    for layer in _layers(loaded):
        experts, s = layer.get_base_layer(), layer.scaling["default"]
        A, B = layer.lora_A["default"], layer.lora_B["default"]
        expected.append({n: decode_mxfp4(getattr(experts, f"{n}_packed"), getattr(experts, f"{n}_scale"))
                         + s * torch.bmm(getattr(B, n), getattr(A, n)).detach() for n in ("w1", "w3", "w2")})
    merged = loaded.merge_and_unload()
    errors = merge_errors(merged)
    assert len(errors) == 2
    for (name, err), block, exp in zip(errors.items(), _blocks(merged), expected):
        assert isinstance(block.experts, PackedMXFP4Experts)
        for n in ("w1", "w3", "w2"):
            packed, scale = quantize_mxfp4(exp[n])
            assert torch.equal(getattr(block.experts, f"{n}_packed"), packed)
            assert torch.equal(getattr(block.experts, f"{n}_scale"), scale)
            q = decode_mxfp4(packed, scale)
            assert abs(err[n]["relative"] - float((q - exp[n]).norm() / exp[n].norm())) < 1e-6
            # MXFP4 of Gaussian-like weights: about 0.1 of their RMS (round to nearest on a 3-bit grid)
            assert 0 < err[n]["relative"] < 0.15
        assert 0 < err["all"]["of_update"] < float("inf")
    # the merged model is a plain packed model: saved and reloaded byte for byte
    merged.save_pretrained(tmp_path / "merged")
    again = type(merged).from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged.eval()(input_ids=_ids(3)).logits
        assert torch.isfinite(got).all() and torch.equal(again(input_ids=_ids(3)).logits, got)


@needs_peft
def test_trainer_steps_train_the_adapters_only(tmp_path):
    """Three Trainer steps with gradient checkpointing: the experts' adapters (and the attention's) move, the packed
    experts stay as they were, and the loss is finite."""
    from peft import get_peft_model

    starts = torch.randint(0, 93, (12,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(12)) % 93 + 3 for s in starts)]
    base = packed_model()
    packed = [(b.experts.w1_packed.clone(), b.experts.w2_scale.clone()) for b in _blocks(base)]
    model = get_peft_model(base, packed_experts_lora_config(r=R, lora_alpha=ALPHA,
                                                            target_modules=["experts", "q_b_proj"]))
    _randomise_b(model, std=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert any(".experts.lora_A.default.w1" in n for n in before)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, **{_CKPT_ARG: True})
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    after = dict(model.named_parameters())
    assert all(not torch.equal(after[n], p) for n, p in before.items()), "every adapter factor trains"
    for b, (w1, s2) in zip(_blocks(model), packed):
        assert torch.equal(b.experts.get_base_layer().w1_packed, w1)
        assert torch.equal(b.experts.get_base_layer().w2_scale, s2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rank", [8, 4])  # 8: adapters through torch._grouped_mm; 4: a matmul pair per expert
def test_kernel_path_matches_the_exact_path_on_gpu(rank):
    """bf16 activations on the GPU (packed grouped GEMMs, bf16 adapters) against the exact fp32 path on the same
    routes: outputs and gradients within bf16 rounding; the extra memory of a forward and backward stays far below
    one dequantised copy of the experts."""
    E, D, I, T, k = 64, 512, 1024, 64, 4  # experts large against the routed activations, as in a real model
    experts, A, B, x, idx, tw = _module_case(E=E, D=D, I=I, T=T, k=k, r=rank, device="cuda")
    if experts._kernels(x.bfloat16()) is None:
        pytest.skip("the MXFP4 kernels (Triton) are not available on this GPU")
    s = ALPHA / rank
    dy = torch.randn(T, D, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).requires_grad_()
        twd = tw.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        y = packed_experts_lora_forward(experts, xd, idx, twd, [(A, B, s, torch.nn.Identity())])
        grads = torch.autograd.grad(y, [xd, twd, *A.parameters(), *B.parameters()], dy.to(dtype))
        torch.cuda.synchronize()
        results.append((y.detach().float(), [g.float() for g in grads], torch.cuda.max_memory_allocated() - start))
    (y32, g32, _), (y16, g16, peak16) = results
    assert rel_err(y16, y32) < 2e-2
    for a, b in zip(g16, g32):
        assert rel_err(a, b) < 3e-2
    dequantised_bytes = 3 * E * D * I * 2  # the experts in bf16
    assert peak16 < dequantised_bytes / 4, (peak16, dequantised_bytes)
