"""Training with `transformers.Trainer`: loss falls on a small corpus (fp32 and bf16), save / reload / resume,
`output_router_logits`, gradient checkpointing equal to no checkpointing (KDA, MLA, MoE, AttnRes, packed documents,
vision blocks), and packed documents through `DataCollatorWithFlattening` equal to padded batches."""

import dataclasses
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from kimi3_testing import ORACLE_A, rel_err, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM, Kimi3ForConditionalGeneration
from transformers_kimi3.training import packed_collator

VOCAB = 96
# 4 layers: KDA, MLA, KDA, MLA; dense FFN then MoE; AttnRes blocks of 2 layers (bank writes at layers 0 and 2)
SMALL = dict(num_hidden_layers=4, attn_res_block_size=2,
             linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     use_full_rank_gate=True, kda_layers=[1, 3], full_attn_layers=[2, 4]))
# Loss starts at ln(96) = 4.56. Observed after 24 steps: 1.49 (fp32), 1.59 (bf16 autocast); a model that does not
# learn the corpus stays above 3.
LOSS_THRESHOLD = 2.2
_CKPT_ARG = "activation_checkpointing" if any(f.name == "activation_checkpointing" for f in
                                                dataclasses.fields(TrainingArguments)) else "gradient_checkpointing"


def corpus(n, length=16, seed=0, lengths=None):
    """Arithmetic sequences (start s, stride 1 or 2, mod 93): the next token follows from the previous two."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        T = length if lengths is None else int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        s, step = int(torch.randint(0, 93, (1,), generator=g)), int(torch.randint(1, 3, (1,), generator=g))
        ids = (s + step * torch.arange(T)) % 93 + 3
        docs.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
    return docs


def as_tensors(docs):
    return [{k: torch.tensor(v) for k, v in d.items()} for d in docs]


def args(out, steps, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=8, max_steps=steps, learning_rate=1e-2,
                lr_scheduler_type="constant", logging_steps=4, save_strategy="no", report_to=[], use_cpu=True,
                seed=0, data_seed=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def final_loss(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]


def enable_checkpointing(model):
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


# ----------------------------------------------------------------------------- Trainer: fp32, save, reload, resume
def test_trainer_fp32_loss_save_reload_resume(tmp_path):
    data = as_tensors(corpus(96))  # 12 batches per epoch, 24 steps = 2 epochs
    model = tiny_model(**SMALL).train()
    trainer = Trainer(model=model, args=args(tmp_path / "a", 24, save_strategy="steps", save_steps=12),
                      train_dataset=data)
    trainer.train()
    assert final_loss(trainer) < LOSS_THRESHOLD, trainer.state.log_history

    # save -> reload: the same logits
    trainer.save_model(str(tmp_path / "final"))
    reloaded = Kimi3ForCausalLM.from_pretrained(str(tmp_path / "final")).eval()
    x = torch.tensor([corpus(2, seed=7)[0]["input_ids"]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, model(input_ids=x).logits)

    # resume from the step-12 checkpoint: the same final weights as the uninterrupted run (CPU fp32 is
    # deterministic; optimizer, scheduler and RNG states come from the checkpoint)
    resumed = tiny_model(seed=1, **SMALL).train()  # other initial weights: everything must come from the checkpoint
    trainer2 = Trainer(model=resumed, args=args(tmp_path / "b", 24), train_dataset=data)
    trainer2.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-12"))
    final = dict(model.named_parameters())
    for name, p in resumed.named_parameters():
        assert torch.equal(p, final[name]), name
    for (name, b), (_, b_ref) in zip(resumed.named_buffers(), model.named_buffers()):
        assert torch.equal(b, b_ref), name


@pytest.mark.parametrize("cls", ["Kimi3ForCausalLM", "Kimi3ForConditionalGeneration"])
def test_label_smoothing_targets_the_next_token(tmp_path, cls):
    """Trainer's `label_smoothing_factor` computes the loss outside the model and shifts the labels only for the
    class names Transformers lists as causal LMs: ours must be listed, or smoothing trains on the current token."""
    if cls == "Kimi3ForCausalLM":
        model = tiny_model(**SMALL)
    else:  # the bundled tiny K3: what AutoModelForCausalLM gives for a K3 folder
        from kimi3_testing import ROOT

        model = Kimi3ForConditionalGeneration.from_pretrained(os.path.join(ROOT, "assets", "kimi-k3-tiny"),
                                                              dtype=torch.float32)
    assert type(model).__name__ == cls
    model.eval()
    trainer = Trainer(model=model, args=args(tmp_path, 1, label_smoothing_factor=0.1))
    ids = torch.tensor([corpus(2, seed=3)[0]["input_ids"]]) % model.config.get_text_config().vocab_size
    with torch.no_grad():
        loss = trainer.compute_loss(model, {"input_ids": ids, "labels": ids.clone()})
        logits = model(input_ids=ids).logits.float()
    next_token = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], label_smoothing=0.1)
    same_token = torch.nn.functional.cross_entropy(logits[0], ids[0], label_smoothing=0.1)
    assert abs(loss.item() - next_token.item()) < 1e-5 * next_token.item(), (loss.item(), next_token.item())
    assert abs(same_token.item() - next_token.item()) > 1e-3  # the two targets give different numbers here


def test_load_state_dict_reads_the_saved_layout(tmp_path):
    """Trainer's resume_from_checkpoint / load_best_model_at_end call model.load_state_dict on model.safetensors,
    which holds the official layout (per-expert tensors, A_log padded to head_dim) that save_pretrained writes."""
    model = tiny_model(**SMALL)
    model.save_pretrained(tmp_path)
    other = tiny_model(seed=1, **SMALL)
    result = other.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")), False)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, a), (_, b) in zip(other.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


# ----------------------------------------------------------------------------- bf16, router logits
def test_trainer_bf16_autocast_and_bf16_weights(tmp_path):
    data = as_tensors(corpus(96))
    model = tiny_model(**SMALL).train()
    trainer = Trainer(model=model, args=args(tmp_path / "a", 24, bf16=True), train_dataset=data)
    trainer.train()
    assert final_loss(trainer) < LOSS_THRESHOLD, trainer.state.log_history
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: fp32 master weights

    # the model itself in bf16 (weights and activations): trains, router statistics in fp32
    model = tiny_model(**SMALL).to(torch.bfloat16).train()
    trainer = Trainer(model=model, args=args(tmp_path / "b", 12, logging_steps=1), train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]  # observed 4.59 -> 3.50
    assert all(math.isfinite(v) for v in losses) and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    x = torch.tensor([d["input_ids"] for d in corpus(2, seed=3)])
    out = model(input_ids=x, labels=x, output_router_logits=True)
    assert len(out.router_logits) == 3 and all(r.dtype == torch.float32 and r.shape == (32, 8)
                                                for r in out.router_logits)
    assert out.router_logits[0].requires_grad  # the router is trained through the LM loss


# ----------------------------------------------------------------------------- gradient checkpointing
def _loss_and_grads(model, **inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _count_calls(modules):
    """Pre-hooks: the recompute stops as soon as the last saved tensor is rebuilt (non-reentrant checkpoint's early
    stop), so a module that ends a checkpointed region never returns there and a post-hook would not see it."""
    calls = []
    handles = [m.register_forward_pre_hook(lambda mod, a, i=i: calls.append(i)) for i, m in enumerate(modules)]
    return calls, handles


# Same math recomputed in the same order: in practice bit-identical; the bound allows for a different reduction order.
CKPT_TOL = 1e-6


@pytest.mark.parametrize("packed", [False, True])
def test_gradient_checkpointing_same_loss_and_grads(packed):
    model = tiny_model().train()  # 7 layers: KDA and MLA, dense and MoE, AttnRes (block 3: bank writes at 0, 3, 6)
    g = torch.Generator().manual_seed(0)
    if packed:  # documents packed in one row: seq_idx must reach every recomputed layer
        ids = torch.randint(3, VOCAB, (1, 40), generator=g)
        inputs = dict(input_ids=ids, labels=ids, position_ids=torch.cat([torch.arange(n) for n in (13, 20, 7)])[None])
    else:
        ids = torch.randint(3, VOCAB, (2, 24), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :6] = 0
        inputs = dict(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)
    ref_loss, ref_grads = _loss_and_grads(model, **inputs)

    enable_checkpointing(model)
    layers = model.model.layers
    watched = [layers[0].self_attn, layers[3].self_attn, layers[1].block_sparse_moe, layers[0].mlp]  # KDA MLA MoE MLP
    calls, handles = _count_calls(watched)
    loss, grads = _loss_and_grads(model, **inputs)
    for h in handles:
        h.remove()
    assert [calls.count(i) for i in range(4)] == [2, 2, 2, 2]  # forward + recompute in backward: checkpointed

    assert rel_err(loss, ref_loss) < CKPT_TOL
    assert set(grads) == set(ref_grads)
    covered = {"self_attn.q_conv1d", "self_attn.A_log", "self_attn.kv_b_proj", "experts.w1", "gate.weight",
               "shared_experts.up_proj", "self_attention_res_proj", "mlp_res_norm", "output_attn_res_proj"}
    assert all(any(c in n for n in grads) for c in covered)
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < CKPT_TOL, (n, rel_err(grads[n], ref_grads[n]))


@pytest.mark.skipif(not os.path.isdir(ORACLE_A), reason="../shared/oracle/A is not present")
def test_gradient_checkpointing_vision_blocks():
    """Kimi3ForConditionalGeneration on oracle A with its image: the vision blocks are checkpointed too."""
    model = Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A, dtype=torch.float32).train()
    ref = load_file(os.path.join(ORACLE_A, "inputs_and_logits.safetensors"))
    ids = ref["mm_input_ids"]
    inputs = dict(input_ids=ids, attention_mask=ref["mm_attention_mask"], pixel_values=ref["mm_pixel_values"],
                  grid_thws=ref["mm_grid_thws"], labels=ids)
    ref_loss, ref_grads = _loss_and_grads(model, **inputs)
    enable_checkpointing(model)
    assert model.vision_tower.gradient_checkpointing
    blocks = list(model.vision_tower.encoder.blocks)
    calls, handles = _count_calls(blocks + [model.language_model.model.layers[3].input_layernorm])
    loss, grads = _loss_and_grads(model, **inputs)
    for h in handles:
        h.remove()
    assert [calls.count(i) for i in range(len(blocks) + 1)] == [2] * (len(blocks) + 1)
    assert rel_err(loss, ref_loss) < CKPT_TOL
    assert any(n.startswith("vision_tower.encoder.blocks.0.") for n in grads)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < CKPT_TOL, (n, rel_err(grads[n], ref_grads[n]))


def test_trainer_with_gradient_checkpointing(tmp_path):
    data = as_tensors(corpus(32))
    plain = Trainer(model=tiny_model(**SMALL).train(), args=args(tmp_path / "a", 3, logging_steps=1),
                    train_dataset=data)
    plain.train()
    ckpt_model = tiny_model(**SMALL).train()
    ckpt = Trainer(model=ckpt_model, args=args(tmp_path / "b", 3, logging_steps=1, **{_CKPT_ARG: True}),
                   train_dataset=data)
    ckpt.train()
    assert ckpt_model.model.layers[0].gradient_checkpointing
    a = [h["loss"] for h in plain.state.log_history if "loss" in h]
    b = [h["loss"] for h in ckpt.state.log_history if "loss" in h]
    assert len(a) == 3 and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)), (a, b)


# ----------------------------------------------------------------------------- packed documents through Trainer
def pad_collator(features):
    """Right-padded batch with attention_mask; padded labels -100."""
    T = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), T, dtype=torch.long)
    labels = torch.full((len(features), T), -100)
    mask = torch.zeros(len(features), T, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def flash_kwargs_collator():
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False, separator_id=-100)


@pytest.mark.parametrize("collator", ["position_ids", "flash_kwargs"])
def test_packed_collator_equals_padded_batches(tmp_path, collator):
    """DataCollatorWithFlattening rows (documents of 5-20 tokens) through Trainer: the eval loss is the mean NLL over
    the documents' own next-token targets, equal to padded batches and to a per-document computation; training
    steps give the same losses and weights."""
    packed = packed_collator() if collator == "position_ids" else flash_kwargs_collator()
    docs = corpus(16, lengths=(5, 20), seed=4)
    model = tiny_model(**SMALL).eval()

    batch = packed(docs[:8])
    assert batch["input_ids"].shape[0] == 1
    assert ("position_ids" in batch) == (collator == "position_ids") and ("cu_seq_lens_q" in batch) != (
        collator == "position_ids")

    kw = dict(per_device_eval_batch_size=16)
    eval_packed = Trainer(model=model, args=args(tmp_path / "e1", 1, **kw), data_collator=packed)
    eval_padded = Trainer(model=model, args=args(tmp_path / "e2", 1, **kw), data_collator=pad_collator)
    loss_packed = eval_packed.evaluate(docs)["eval_loss"]
    loss_padded = eval_padded.evaluate(docs)["eval_loss"]
    nll, count = 0.0, 0
    with torch.no_grad():
        for d in docs:  # each document alone
            x = torch.tensor([d["input_ids"]])
            lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
            nll -= float(lp.gather(-1, x[0, 1:, None]).sum())
            count += x.shape[1] - 1
    assert abs(loss_packed - nll / count) < 1e-5 * nll / count
    assert abs(loss_packed - loss_padded) < 1e-5 * loss_padded

    # three training steps each way: the same losses step by step and the same weights
    runs = []
    for name, coll in (("p", packed), ("q", pad_collator)):
        m = tiny_model(**SMALL).train()
        t = Trainer(model=m, args=args(tmp_path / name, 3, logging_steps=1, learning_rate=1e-3),
                    train_dataset=docs, data_collator=coll)
        t.train()
        runs.append((m, [h["loss"] for h in t.state.log_history if "loss" in h]))
    (m1, l1), (m2, l2) = runs
    assert len(l1) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(l1, l2)), (l1, l2)
    # Adam normalises each coordinate, so fp32 rounding differences in tiny gradients show up at ~lr scale at most
    worst = max(float((p1 - p2).detach().abs().max()) for p1, p2 in zip(m1.parameters(), m2.parameters()))
    assert worst < 1e-4, worst
