"""Transformers conventions: labels -> loss, logits_to_keep, hidden states, router logits, dtype handling, init."""

import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kimi3_testing import ORACLE_A, needs_oracle, rel_err, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM


def test_labels_give_the_shifted_cross_entropy():
    model = tiny_model()
    ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(input_ids=ids, labels=labels)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 96).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, ref, atol=1e-6)


def test_logits_to_keep_hidden_states_and_router_logits():
    model = tiny_model()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    full = model(input_ids=ids, output_hidden_states=True, output_router_logits=True)
    last = model(input_ids=ids, logits_to_keep=1)
    assert last.logits.shape == (1, 1, 96) and torch.allclose(last.logits[:, 0], full.logits[:, -1], atol=1e-6)
    cfg = model.config
    assert len(full.hidden_states) == cfg.num_hidden_layers + 1
    n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    assert len(full.router_logits) == n_moe and full.router_logits[0].shape == (12, cfg.num_experts)


@needs_oracle
def test_bf16_load_keeps_fp32_modules_and_stays_close():
    o = load_file(os.path.join(ORACLE_A, "inputs_and_logits.safetensors"))
    model = Kimi3ForCausalLM.from_pretrained(ORACLE_A, dtype=torch.bfloat16)
    fp32 = {n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.dtype == torch.float32}
    for suffix in ("A_log", "dt_bias", "q_conv1d.weight", "o_norm.weight", "e_score_correction_bias"):
        assert any(n.endswith(suffix) for n in fp32), suffix
    assert model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        lg = model(input_ids=o["text_input_ids"][:1]).logits.float()
    ref = o["text_logits"][:1]
    # bf16 end to end through 8 random layers: a few percent, and the argmax mostly kept
    assert rel_err(lg, ref) < 0.2
    assert (lg.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_init_follows_fla_and_attnres_conventions():
    model = Kimi3ForCausalLM(tiny_k3_text_config())
    layer = model.model.layers[0]
    assert torch.count_nonzero(layer.self_attn.A_log) == 0  # bounded (safe) gate: A_log = 0
    dt = F.softplus(layer.self_attn.dt_bias)
    assert dt.min() >= 1e-4 * 0.999 and dt.max() <= 0.1 * 1.001
    assert torch.count_nonzero(layer.mlp_res_proj.weight) == 0  # uniform AttnRes mixing at the start
    assert torch.count_nonzero(model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias) == 0
    assert "Kimi3DecoderLayer" in model._no_split_modules
