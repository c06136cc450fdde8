"""Quantisation-aware fine-tuning (`prepare_qat`): the fake-quantised forward, straight-through gradients, the packed
model saved after QAT computing the QAT model's forward, gradient checkpointing and a few Trainer steps."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from kimi3_testing import rel_err, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM, prepare_qat
from transformers_kimi3.moe import Kimi3Experts, Kimi3SparseMoeBlock
from transformers_kimi3.mxfp4 import decode_mxfp4, quantize_mxfp4
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts
from transformers_kimi3.qat import QATExperts, fake_quantize_mxfp4

# two MLA layers, both MoE: every QAT mechanism at the smallest cost
MICRO = dict(num_hidden_layers=2, first_k_dense_replace=0, attn_res_block_size=1,
             linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     use_full_rank_gate=True, kda_layers=[], full_attn_layers=[1, 2]))
_CKPT_ARG = "activation_checkpointing" if any(f.name == "activation_checkpointing" for f in
                                                dataclasses.fields(TrainingArguments)) else "gradient_checkpointing"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention on a 2-core runner
    yield
    torch.set_num_threads(n)


def _dq(w):
    return decode_mxfp4(*quantize_mxfp4(w), w.dtype)


def _experts(model):
    return [b.experts for b in model.modules() if isinstance(b, Kimi3SparseMoeBlock)]


def _ids(seed=0, T=10):
    return torch.randint(3, 96, (2, T), generator=torch.Generator().manual_seed(seed))


def _pair(fmt, seed=0):
    """(QATExperts, Kimi3Experts holding the QAT masters' quantised values) on one config."""
    config = tiny_k3_text_config(num_experts=4, moe_intermediate_size=32, moe_activation_format=fmt)
    g = torch.Generator().manual_seed(seed)
    plain = Kimi3Experts(config, 64)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    qat = QATExperts.from_experts(plain, config)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(_dq(p))
    return qat, plain


def _routes(T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
    return torch.randn(T, 64, generator=g), idx, torch.rand(T, 2, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_is_dequantize_of_quantize(dtype):
    w = (torch.randn(3, 16, 64) * 0.1).to(dtype)
    got = fake_quantize_mxfp4(w)
    assert got.dtype == dtype and torch.equal(got, decode_mxfp4(*quantize_mxfp4(w), dtype))


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_qat_forward_and_straight_through_gradients(fmt):
    """The QAT forward is the forward of the quantised weights, and the gradient with respect to each master weight
    is the gradient with respect to its quantised value."""
    qat, plain = _pair(fmt)
    x, idx, tw = _routes()
    dy = torch.randn(x.shape[0], 64, generator=torch.Generator().manual_seed(2))
    outs = []
    for mod in (qat, plain):
        y = mod(x, idx, tw)
        y.backward(dy)
        outs.append(y.detach())
    assert torch.equal(outs[0], outs[1])
    for n in ("w1", "w3", "w2"):
        assert torch.equal(getattr(qat, n).grad, getattr(plain, n).grad), n
        assert getattr(qat, n).grad.abs().sum() > 0


def test_pack_after_qat_reloads_the_qat_forward(tmp_path):
    model = tiny_model(**MICRO)
    prepare_qat(model, activations="mxfp8")
    assert all(isinstance(e, QATExperts) and e.activation_format == "mxfp8" for e in _experts(model))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    for step in range(2):  # move the masters off the MXFP4 grid
        model(input_ids=_ids(step), labels=_ids(step)).loss.backward()
        opt.step()
        opt.zero_grad()
    masters = [e.w1.detach().clone() for e in _experts(model)]
    assert not torch.equal(masters[0], _dq(masters[0]))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=_ids(5)).logits
    model.save_pretrained(tmp_path)

    packed = Kimi3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert all(isinstance(e, PackedMXFP4Experts) and e.activation_format == "mxfp8" for e in _experts(packed))
    with torch.no_grad():
        got = packed(input_ids=_ids(5)).logits
    assert rel_err(got, want) < 1e-6

    # QAT of the packed model starts from its exact values: the same forward
    prepare_qat(packed, activations="mxfp8")
    with torch.no_grad():
        assert torch.equal(packed(input_ids=_ids(5)).logits, got)
    # the saved file loads into a QAT model (Trainer's resume): masters = the packed values
    other = prepare_qat(tiny_model(seed=1, **MICRO), activations="mxfp8")
    result = other.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    for e, m in zip(_experts(other), masters):
        assert torch.equal(e.w1, _dq(m))


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = prepare_qat(tiny_model(**MICRO), activations="mxfp8").train()
        if checkpointing:
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        grads.append([e.w2.grad for e in _experts(model)])
    for a, b in zip(*grads):
        assert a.abs().sum() > 0 and torch.equal(a, b)


def test_trainer_steps_reduce_the_loss(tmp_path):
    starts = torch.randint(0, 93, (32,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(12)) % 93 + 3 for s in starts)]
    model = prepare_qat(tiny_model(**MICRO), activations="mxfp8").train()
    before = [e.w1.detach().clone() for e in _experts(model)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8, learning_rate=1e-2,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, **{_CKPT_ARG: True})
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    assert all(isinstance(e, QATExperts) and not torch.equal(e.w1, w) for e, w in zip(_experts(model), before))
