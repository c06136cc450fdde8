"""Quantisation-aware fine-tuning (`prepare_qat`): the fake-quantised forward, straight-through gradients, the packed
model saved after QAT computing the QAT model's forward, masters in another dtype than the activations, gradient
checkpointing, Trainer steps with gradient checkpointing and Quantile Balancing whose saved folder reloads to the
trained model's logits, and a Trainer run resumed from a checkpoint ending with the uninterrupted run's masters
(`QATMastersCallback`) or, without the callback, elsewhere; masters files that do not fit the model are refused."""


import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from kimi3_testing import MOE_MICRO, checkpointing_argument, rel_err, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM, QATMastersCallback, prepare_qat
from transformers_kimi3.moe import Kimi3Experts, Kimi3SparseMoeBlock
from transformers_kimi3.mxfp4 import decode_mxfp4, quantize_mxfp4
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts
from transformers_kimi3.qat import QAT_MASTERS_NAME, QATExperts, fake_quantize_mxfp4, load_qat_masters, qat_masters
from transformers_kimi3.training import QuantileBalancingCallback, find_routers

MICRO = MOE_MICRO
_CKPT_ARG = checkpointing_argument()


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


def test_master_dtype_does_not_change_the_forward():
    """bf16 masters in an fp32 model compute in fp32 (every MXFP4 value is exact in both dtypes): the logits of fp32
    masters holding the same values, and their gradients rounded to bf16; fp32 masters under bf16 activations train."""
    bf16_masters = prepare_qat(tiny_model(**MICRO), master_dtype=torch.bfloat16)
    fp32_masters = prepare_qat(tiny_model(**MICRO))
    with torch.no_grad():
        for a, b in zip(_experts(bf16_masters), _experts(fp32_masters)):
            for n in ("w1", "w3", "w2"):
                assert getattr(a, n).dtype == torch.bfloat16
                getattr(b, n).copy_(getattr(a, n))
    out_a = bf16_masters(input_ids=_ids(), labels=_ids())
    out_b = fp32_masters(input_ids=_ids(), labels=_ids())
    assert out_a.logits.dtype == torch.float32 and torch.equal(out_a.logits, out_b.logits)
    out_a.loss.backward()
    out_b.loss.backward()
    for a, b in zip(_experts(bf16_masters), _experts(fp32_masters)):
        assert a.w2.grad.dtype == torch.bfloat16 and torch.equal(a.w2.grad, b.w2.grad.to(torch.bfloat16))

    bf16_model = prepare_qat(tiny_model(**MICRO).to(torch.bfloat16), master_dtype=torch.float32)
    loss = bf16_model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(e.w1.dtype == torch.float32 and e.w1.grad.abs().sum() > 0 for e in _experts(bf16_model))


@pytest.mark.parametrize("activations", [None, "mxfp8"])
def test_trainer_with_checkpointing_and_quantile_balancing(tmp_path, activations):
    """Trainer steps on a QAT model with gradient checkpointing and Quantile Balancing: the loss falls, the masters and
    the router biases move, and the folder `Trainer.save_model` writes (packed MXFP4) reloads to the trained QAT
    model's eval logits (fp32, relative error below 1e-6)."""
    starts = torch.randint(0, 93, (32,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(12)) % 93 + 3 for s in starts)]
    model = prepare_qat(tiny_model(**MICRO), activations=activations).train()
    before = [e.w1.detach().clone() for e in _experts(model)]
    biases = [r.e_score_correction_bias.clone() for _, _, r in find_routers(model)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8, learning_rate=1e-2,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, **{_CKPT_ARG: True})
    balancing = QuantileBalancingCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[balancing])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    assert all(isinstance(e, QATExperts) and not torch.equal(e.w1, w) for e, w in zip(_experts(model), before))
    assert len(balancing.history) == 8
    assert all(not torch.equal(r.e_score_correction_bias, b) for (_, _, r), b in zip(find_routers(model), biases))

    model.eval()
    with torch.no_grad():
        want = model(input_ids=_ids(5)).logits
    trainer.save_model(str(tmp_path / "final"))
    packed = Kimi3ForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    assert all(isinstance(e, PackedMXFP4Experts) for e in _experts(packed))
    with torch.no_grad():
        got = packed(input_ids=_ids(5)).logits
    assert rel_err(got, want) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qat_trains_generates_and_reloads_on_gpu(tmp_path):
    """bf16 QAT on the GPU with fp32 masters (the experts through torch._grouped_mm on the fake-quantised weights, the
    decode kernels in generation): a training step moves the masters, and the packed reload (MXFP4 kernels) gives
    the QAT model's logits within bf16 rounding."""
    model = prepare_qat(tiny_model(**MICRO).to("cuda", torch.bfloat16), master_dtype=torch.float32).train()
    before = [e.w1.detach().clone() for e in _experts(model)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = _ids().cuda()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(e.w1.dtype == torch.float32 and not torch.equal(e.w1, w) for e, w in zip(_experts(model), before))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        generated = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 7)
    model.save_pretrained(tmp_path)
    packed = Kimi3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to("cuda").eval()
    assert all(isinstance(e, PackedMXFP4Experts) for e in _experts(packed))
    with torch.no_grad():
        got = packed(input_ids=ids).logits.float()
    assert rel_err(got, want) < 5e-2


# ----------------------------------------------------------------------------- resuming a Trainer run exactly
RESUME_STEPS = 4  # checkpoint at RESUME_STEPS // 2


def _resume_args(folder, **kw):
    return TrainingArguments(output_dir=str(folder), per_device_train_batch_size=4, max_steps=RESUME_STEPS,
                             learning_rate=1e-2, lr_scheduler_type="linear", logging_steps=1, report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, **kw)


def _resume_data():
    starts = torch.randint(0, 93, (4 * RESUME_STEPS,), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(12)) % 93 + 3 for s in starts)]


def _qat_trainer(folder, callbacks=(), **kw):
    model = prepare_qat(tiny_model(**MICRO)).train()
    return Trainer(model=model, args=_resume_args(folder, **kw), train_dataset=_resume_data(),
                   callbacks=list(callbacks))


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _masters(model):
    return {n: p.detach().clone() for n, p in qat_masters(model).items()}


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """The masters of an uninterrupted run of RESUME_STEPS Trainer steps, and the folder of a run of the same
    schedule stopped at its checkpoint of step RESUME_STEPS // 2, written with `QATMastersCallback`."""
    straight = _qat_trainer(tmp_path_factory.mktemp("straight"), save_strategy="no")
    straight.train()
    folder = tmp_path_factory.mktemp("interrupted")
    half = RESUME_STEPS // 2
    first = _qat_trainer(folder, [QATMastersCallback(), _StopAt(half)], save_strategy="steps", save_steps=half)
    first.train()
    checkpoint = folder / f"checkpoint-{half}"
    # the checkpoint's masters are exact; its model weights hold them quantised
    saved = load_file(checkpoint / QAT_MASTERS_NAME)
    assert saved.keys() == qat_masters(first.model).keys()
    assert all(torch.equal(saved[n], p) for n, p in qat_masters(first.model).items())
    assert any(not torch.equal(w, _dq(w)) for w in saved.values())
    return _masters(straight.model), folder, checkpoint


def test_callback_resumes_the_exact_masters(interrupted_run):
    """Resumed from the half-way checkpoint, the run ends with the uninterrupted run's masters, bit for bit, with
    `QATMastersCallback`; without it the masters restart from their quantised values and end elsewhere."""
    want, folder, checkpoint = interrupted_run
    resumed = _qat_trainer(folder, save_strategy="no")
    cb = QATMastersCallback.attach(resumed)
    assert resumed.callback_handler.callbacks[0] is cb
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint under output_dir
    assert resumed.state.global_step == RESUME_STEPS
    assert cb.loaded == str(checkpoint / QAT_MASTERS_NAME)
    got = _masters(resumed.model)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)

    plain = _qat_trainer(folder, save_strategy="no")
    plain.train(resume_from_checkpoint=str(checkpoint))
    got = _masters(plain.model)
    assert all(not torch.equal(got[n], want[n]) for n in want)


def test_resume_without_masters_warns_and_mismatched_masters_are_refused(interrupted_run, tmp_path, caplog):
    _, _, checkpoint = interrupted_run
    args = _resume_args(tmp_path, resume_from_checkpoint=str(checkpoint))
    cb = QATMastersCallback()

    def resume(model, state_step=RESUME_STEPS // 2):
        prepare_qat(model)
        model.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)  # Trainer's weight loading
        cb.on_train_begin(args, TrainerState(global_step=state_step), TrainerControl(), model=model)
        return model

    model = resume(tiny_model(**MICRO))  # the Trainer checkpoint's masters file, named by args.resume_from_checkpoint
    assert cb.loaded == str(checkpoint / QAT_MASTERS_NAME)
    saved = load_file(checkpoint / QAT_MASTERS_NAME)
    assert all(torch.equal(p, saved[n]) for n, p in qat_masters(model).items())
    with caplog.at_level("WARNING", logger="transformers_kimi3"):  # no masters of step 1 in the folders searched
        resume(tiny_model(**MICRO), state_step=1)
    assert cb.loaded is None and "continues from the quantised masters" in caplog.text and "checkpoint-1" in caplog.text

    with pytest.raises(ValueError, match="has no QATExperts"):
        cb.on_train_begin(args, TrainerState(global_step=2), TrainerControl(), model=tiny_model(**MICRO))
    other = prepare_qat(tiny_model(**dict(MICRO, moe_intermediate_size=64)))  # other shapes, through the callback
    with pytest.raises(ValueError, match=r"qat_masters\.safetensors: model\.layers\.0\..*experts\.w1 is torch\.float32 "
                                         r"\(8, 32, 32\) in the file, torch\.float32 \(8, 64, 32\) in the model"):
        cb.on_train_begin(args, TrainerState(global_step=2), TrainerControl(), model=other)

    bad = tmp_path / "bad"
    bad.mkdir()
    for name, edit in (("renamed", lambda t: {k.replace("layers.0", "layers.9"): v for k, v in t.items()}),
                       ("bf16", lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()}),
                       ("moved", lambda t: {k: v + 1 for k, v in t.items()})):
        save_file(edit(load_file(checkpoint / QAT_MASTERS_NAME)), bad / QAT_MASTERS_NAME, metadata={"global_step": "2"})
        model = prepare_qat(tiny_model(**MICRO))
        model.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)
        match = {"renamed": r"master .*layers\.0\..*w1 is missing", "bf16": r"is torch\.bfloat16 .* in the file",
                 "moved": "does not quantise to the model's weights"}[name]
        with pytest.raises(ValueError, match=match) as e:
            load_qat_masters(model, bad)
        assert str(bad / QAT_MASTERS_NAME) in str(e.value), name
        assert all(torch.equal(p, _dq(p)) for p in qat_masters(model).values())  # nothing loaded
