"""PEFT LoRA on Kimi3: attention projections (KDA and MLA), gates, dense and shared-expert MLPs, the latent MoE
projections and the routed experts' 3-D weights (`target_parameters`); save / reload the adapter, merge it, train it
with Trainer (and resume from its checkpoint); adapters next to frozen MXFP4 experts."""

import os

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kimi3_testing import rel_err, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj",  # KDA (and o_proj of MLA)
             "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]  # MLA
GATES = ["g_proj", "f_a_proj", "f_b_proj", "b_proj"]  # KDA output / forget / beta gates, MLA output gate
MLPS = ["gate_proj", "up_proj", "down_proj",  # dense MLP and shared experts
        "routed_expert_down_proj", "routed_expert_up_proj"]  # the latent MoE projections
EXPERTS = ["experts.w1", "experts.w2", "experts.w3"]  # routed experts: nn.Parameters [E, out, in]
# fp32: adapter vs merged weights is the same function computed in another order. This model's own fp32 rounding
# (fp32 vs fp64 logits) is ~4e-6; the merged model lands at ~5e-6.
MERGE_TOL = 5e-5


def base(seed=0):
    # moe_intermediate_size 48 != latent 32: the experts' [E, out, in] orientation is visible in the LoRA shapes
    return tiny_model(seed=seed, moe_intermediate_size=48)


def lora_config(**kw):
    return LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION + GATES + MLPS, target_parameters=EXPERTS, **kw)


def lora_model(seed=0):
    """LoRA on everything, B ~ N(0, 0.02) instead of zeros so that the adapter changes the outputs from the start
    (PEFT's init_lora_weights=False draws B so large that the model becomes badly conditioned in fp32)."""
    torch.manual_seed(seed)
    model = get_peft_model(base(), lora_config())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def ids(B=2, T=20, seed=0):
    return torch.randint(3, 96, (B, T), generator=torch.Generator().manual_seed(seed))


def test_lora_targets_every_kind_and_all_get_gradients():
    model = lora_model()
    names = [n for n, _ in model.named_modules()]
    layer0, layer1, layer3 = "model.layers.0.", "model.layers.1.", "model.layers.3."
    for target in ["self_attn.q_proj", "self_attn.g_proj", "self_attn.f_a_proj", "self_attn.f_b_proj",
                   "self_attn.b_proj", "self_attn.o_proj"]:
        assert any(n.endswith(layer1 + target + ".lora_A.default") for n in names), target  # KDA
    for target in ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                   "self_attn.kv_b_proj", "self_attn.g_proj", "self_attn.o_proj"]:
        assert any(n.endswith(layer3 + target + ".lora_A.default") for n in names), target  # MLA
    assert any(n.endswith(layer0 + "mlp.gate_proj.lora_A.default") for n in names)
    assert any(n.endswith(layer1 + "block_sparse_moe.shared_experts.down_proj.lora_A.default") for n in names)
    assert any(n.endswith(layer1 + "block_sparse_moe.routed_expert_up_proj.lora_A.default") for n in names)
    # routed experts: PEFT's ParamWrapper, one rank-4 factor pair per expert; PEFT reads our [E, out, in] layout
    experts = model.base_model.model.model.layers[1].block_sparse_moe.experts
    wrappers = [m for m in experts.modules() if type(m).__name__ == "ParamWrapper"]
    by_param = {w.parameter_name: w for w in wrappers}
    assert set(by_param) == {"w1", "w2", "w3"}
    E = 8
    assert by_param["w1"].lora_A["default"].weight.shape == (4 * E, 32)  # in = latent 32
    assert by_param["w1"].lora_B["default"].weight.shape == (48, 4 * E)  # out = expert intermediate 48
    assert by_param["w2"].lora_A["default"].weight.shape == (4 * E, 48)
    assert by_param["w1"].get_delta_weight("default").shape == (E, 48, 32)

    out = model(input_ids=ids(), labels=ids())
    out.loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    dead = [n for n, p in trainable.items() if p.grad is None or float(p.grad.abs().max()) == 0]
    assert not dead, dead  # every adapted module is on the compute path
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_adapter_save_reload_and_merge(tmp_path):
    model = lora_model().eval()
    x = ids(seed=1)
    with torch.no_grad():
        plain = base()(input_ids=x).logits
        adapted = model(input_ids=x).logits
    assert rel_err(adapted, plain) > 1e-2  # the adapter does something

    model.save_pretrained(tmp_path / "adapter")
    assert os.path.exists(tmp_path / "adapter" / "adapter_model.safetensors")
    reloaded = PeftModel.from_pretrained(base(), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, adapted)

    merged = reloaded.merge_and_unload()
    assert isinstance(merged, Kimi3ForCausalLM) and not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        merged_logits = merged(input_ids=x).logits
    assert rel_err(merged_logits, adapted) < MERGE_TOL
    # the merged model saves in the official layout and loads back with the same logits
    merged.save_pretrained(tmp_path / "merged")
    again = Kimi3ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, merged_logits)


def test_generate_with_unmerged_adapter_equals_merged():
    """Cached decoding must see the adapter too (MLA's absorbed decode reads kv_b_proj's weight)."""
    model = lora_model().eval()
    x = ids(seed=1)[:1, :8]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        a = model.generate(input_ids=x, **kw)
    merged = model.merge_and_unload()
    with torch.no_grad():
        b = merged.generate(input_ids=x, **kw)
    err = rel_err(torch.stack(a.logits, 1), torch.stack(b.logits, 1))
    assert err < MERGE_TOL, err  # was 0.08 while the absorbed decode read kv_b_proj.weight past the LoRA wrapper
    assert torch.equal(a.sequences, b.sequences)


def test_lora_trainer_gradient_checkpointing_and_resume(tmp_path):
    data = [{"input_ids": t, "labels": t} for t in ids(B=32, T=16, seed=3)]
    def run(out, steps, resume=None, seed=0):
        model = get_peft_model(base(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION + GATES + MLPS,
                                                        target_parameters=EXPERTS))
        model.base_model.model.gradient_checkpointing_enable() if not hasattr(
            model.base_model.model, "activation_checkpointing_enable") else \
            model.base_model.model.activation_checkpointing_enable()
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=steps,
                                 learning_rate=5e-3, lr_scheduler_type="constant", logging_steps=1,
                                 save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, seed=seed,
                                 disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer
    model, trainer = run(tmp_path / "a", 4)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    assert os.path.exists(tmp_path / "a" / "checkpoint-2" / "adapter_model.safetensors")
    resumed, _ = run(tmp_path / "b", 4, resume=str(tmp_path / "a" / "checkpoint-2"))
    ref = {n: p for n, p in model.named_parameters() if "lora_" in n}
    got = {n: p for n, p in resumed.named_parameters() if "lora_" in n}
    assert set(ref) == set(got) and len(ref) > 0
    for n in ref:
        assert torch.equal(ref[n], got[n]), n


def test_lora_with_frozen_mxfp4_experts():
    """The bundled tiny K3 keeps its routed experts MXFP4-packed as on disk (buffers, frozen). LoRA goes on everything
    else; the gradient flows back through the packed experts (routed_expert_down_proj feeds only the experts, so its
    adapter's gradient has crossed them)."""
    from transformers_kimi3 import mxfp4_experts

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets", "kimi-k3-tiny")
    model = Kimi3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    moe = model.model.layers[1].block_sparse_moe
    assert isinstance(moe.experts, mxfp4_experts.PackedMXFP4Experts)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION + GATES + MLPS))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    x = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    peft_model(input_ids=x, labels=x).loss.backward()
    down = peft_model.base_model.model.model.layers[1].block_sparse_moe.routed_expert_down_proj
    assert down.lora_B["default"].weight.grad is not None and float(down.lora_B["default"].weight.grad.abs().max()) > 0
    assert not any(p.requires_grad for p in moe.experts.parameters())
    assert all(not b.requires_grad and b.grad is None for b in moe.experts.buffers())


def test_all_linear_adapts_every_projection_and_one_exclusion_leaves_no_dead_adapter():
    """`target_modules="all-linear"` (PEFT picks every nn.Linear but the head) also wraps the AttnRes projections,
    among them layer 0's `self_attention_res_proj`, which no output depends on (docs/distributed.md): its adapter
    gets no gradient, which DDP with find_unused_parameters=False refuses. Excluding that one module (the docs'
    advice) leaves every adapter on the compute path."""
    def dead(config):
        torch.manual_seed(0)
        model = get_peft_model(base(), config)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        model(input_ids=ids(), labels=ids()).loss.backward()
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert any("res_proj.lora_A" in n for n in trainable) and any("q_proj.lora_A" in n for n in trainable)
        return sorted(n for n, p in trainable.items() if p.grad is None or float(p.grad.abs().max()) == 0)

    found = dead(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert found and all(".layers.0.self_attention_res_proj." in n for n in found), found
    assert dead(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                           exclude_modules=["layers.0.self_attention_res_proj"])) == []
