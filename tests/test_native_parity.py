"""Kimi Linear checkpoints written by Transformers' native KimiLinearForCausalLM load into our classes and give
the same logits and greedy tokens."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
KimiLinearConfig = getattr(transformers, "KimiLinearConfig", None)
pytestmark = pytest.mark.skipif(KimiLinearConfig is None, reason="this Transformers has no native Kimi Linear")

import importlib  # noqa: E402
import sys  # noqa: E402

from kimi3_testing import rel_err  # noqa: E402
from transformers_kimi3 import Kimi3ForCausalLM  # noqa: E402

NATIVE = "transformers.models.kimi_linear.modeling_kimi_linear"


def _native_module_without_fla():
    """The native model binds fla's GPU kernels at import when fla is installed; on CPU we need its PyTorch path,
    so import it once with fla hidden, then give fla back to the rest of the process."""
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.") or k == NATIVE}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None
    try:
        return importlib.import_module(NATIVE)
    finally:
        del sys.modules["fla"]
        sys.modules.update({k: v for k, v in saved.items() if k != NATIVE})


native_lib = _native_module_without_fla()


def native_model(q_lora_rank=None):
    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=80, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_local_experts=6, num_experts_per_tok=2, linear_head_dim=16,
        linear_num_heads=3, routed_scaling_factor=2.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
    model = native_lib.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_native_checkpoint_logits_and_generation(tmp_path, q_lora_rank):
    native = native_model(q_lora_rank)
    native.save_pretrained(tmp_path)
    ours = Kimi3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 80, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = native(input_ids=ids, use_cache=False).logits
        got = ours(input_ids=ids, use_cache=False).logits
    assert rel_err(got, ref) < 1e-4
    with torch.no_grad():
        ref_gen = native.generate(ids[:, :20], max_new_tokens=6, do_sample=False, pad_token_id=0)
        got_gen = ours.generate(ids[:, :20], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ref_gen, got_gen)


def test_native_layout_round_trips_through_our_save(tmp_path):
    native = native_model()
    native.save_pretrained(tmp_path / "native")
    ours = Kimi3ForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32)
    ours.save_pretrained(tmp_path / "ours")
    back = native_lib.KimiLinearForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.randint(3, 80, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(back(input_ids=ids).logits, native(input_ids=ids).logits) < 1e-6
