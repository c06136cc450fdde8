"""Kimi Linear checkpoints written by Transformers' native KimiLinearForCausalLM load into our classes and give
the same logits and greedy tokens."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
KimiLinearConfig = getattr(transformers, "KimiLinearConfig", None)
pytestmark = pytest.mark.skipif(KimiLinearConfig is None, reason="this Transformers has no native Kimi Linear")

from kimi3_testing import native_kimi_linear, native_kimi_linear_module, rel_err  # noqa: E402
from transformers_kimi3 import Kimi3ForCausalLM  # noqa: E402

native_model = native_kimi_linear
native_lib = native_kimi_linear_module()


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
