"""Regression tests for the defects Transformers' common tests found in our models (issue 51), each named by what
broke, on tiny models built by the tester classes."""

import pytest
import torch

from testers import K3MXFP4Tester, K3Tester, Kimi3MultimodalTester, KimiLinearTester
from transformers_kimi3 import Kimi3ForCausalLM, Kimi3ForConditionalGeneration, Kimi3Model
from transformers_kimi3.moe import Kimi3Experts

pytestmark = pytest.mark.transformers_common


def test_beam_search_and_several_sequences_repeat_each_rows_images_whole():
    """generate(num_beams / num_return_sequences > 1) with images: Transformers repeats every tensor row by row, which
    for pixel_values (patches of all images packed together) gave each image patches of others. Rows with different
    numbers of images must get their own images, each as a whole block, `expand` times."""
    tester = Kimi3MultimodalTester(None)
    config = tester.get_config()
    model = Kimi3ForConditionalGeneration(config).eval()
    m = tester.media_token
    ids = torch.tensor([[5, m, 6, m], [m, 7, 8, 9]])  # row 0: two images, row 1: one
    grids = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 2, 2]])
    patches = [torch.full((int(g.prod()), 3, 4, 4), float(i)) for i, g in enumerate(grids)]
    ids2, kwargs = model._expand_inputs_for_generation(expand_size=2, input_ids=ids, pixel_values=torch.cat(patches),
                                                       grid_thws=grids, attention_mask=torch.ones_like(ids))
    assert torch.equal(ids2, ids.repeat_interleave(2, 0))
    assert kwargs["grid_thws"].tolist() == [[1, 2, 2], [1, 2, 4]] * 2 + [[1, 2, 2]] * 2
    images = [0, 1, 0, 1, 2, 2]  # the image each block of the expanded pixel_values must come from
    assert torch.equal(kwargs["pixel_values"], torch.cat([patches[i] for i in images]))
    assert kwargs["attention_mask"].shape == (4, 4)


def test_packed_mxfp4_experts_are_reinitialised_from_the_meta_device():
    """A model built on the meta device and materialised (`to_empty`, then `init_weights`) held the uninitialised
    memory of its packed experts: `_init_weights` now writes their construction values (codes 0, scales 2^0)."""
    config = K3MXFP4Tester(None).get_config()
    with torch.device("meta"):
        model = Kimi3ForCausalLM(config)
    model.to_empty(device="cpu")
    for experts in (m for m in model.modules() if type(m).__name__ == "PackedMXFP4Experts"):
        for name in ("w1", "w3", "w2"):
            getattr(experts, f"{name}_packed").fill_(0xAB)
            getattr(experts, f"{name}_scale").fill_(0xAB)
    model.init_weights()
    packed = [m for m in model.modules() if type(m).__name__ == "PackedMXFP4Experts"]
    assert packed
    for experts in packed:
        for name in ("w1", "w3", "w2"):
            assert (getattr(experts, f"{name}_packed") == 0).all() and (getattr(experts, f"{name}_scale") == 127).all()
        w1, w3, w2 = experts.dequantize(torch.float32)
        assert not (w1.any() or w3.any() or w2.any())


@pytest.mark.parametrize("model_class", [Kimi3Model, Kimi3ForCausalLM])
def test_parallel_plans_of_packed_experts_name_no_expert_weights(model_class):
    """Packed MXFP4 experts have no w1 / w3 / w2 to split: the tensor-parallel plan named them anyway, and its
    `moe_tp_experts` all-reduce would sum the outputs of experts every rank holds whole. Packed: no routed-expert
    entries in the TP or EP plan, and every entry names a module or tensor; bf16 experts keep theirs."""
    for tester, packed in ((K3MXFP4Tester, True), (K3Tester, False)):
        model = model_class(tester(None).get_config())
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()} | \
            {n for n, _ in model.named_modules()}
        plans = dict(model.tp_plan, **model.ep_plan)
        expert_entries = [k for k in plans if ".experts" in k or k.endswith("block_sparse_moe.gate")]
        assert bool(expert_entries) != packed, (tester.__name__, expert_entries)
        import re
        for pattern in model.tp_plan:
            regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
            assert any(regex.match(n) for n in names), pattern


def test_experts_interface_defaults_to_the_own_path_and_runs_transformers_functions():
    """The bf16 experts are built on Transformers' experts interface: the default is their own path ("eager", the
    decode kernels and sorted segments), and "batched_mm" / "grouped_mm" run Transformers' functions on views of the
    same weights with the same result (fp32: 1e-5 relative to the largest logit, the sums run in another order).
    MXFP8 activations need the own path and say so."""
    config, inputs = KimiLinearTester(None).prepare_config_and_inputs_for_common()
    torch.manual_seed(0)
    model = Kimi3ForCausalLM(config).eval()
    assert model.config._experts_implementation == "eager"
    with torch.no_grad():
        own = model(**inputs).logits
        for impl in ("batched_mm", "grouped_mm"):
            model.set_experts_implementation(impl)
            got = model(**inputs).logits
            assert float((got - own).abs().max() / own.abs().max()) < 1e-5, impl
    experts = next(m for m in model.modules() if isinstance(m, Kimi3Experts))
    assert torch.equal(experts.gate_up_proj, torch.cat([experts.w1, experts.w3], 1))
    assert experts.down_proj is experts.w2
    mxfp8 = Kimi3ForCausalLM(KimiLinearTester(None).get_config().__class__(
        **dict(KimiLinearTester(None).config_kwargs(), moe_activation_format="mxfp8"))).eval()
    mxfp8.set_experts_implementation("grouped_mm")
    with pytest.raises(ValueError, match="experts_implementation='eager'"), torch.no_grad():
        mxfp8(**inputs)
