"""Expert offloading (`transformers_kimi3.offload_experts`): logits and greedy tokens equal the plain model's bit for
bit (packed MXFP4 and float experts; a cache of all experts, half, and one, which is fewer than a step needs), the
per-layer hit / miss / byte accounting and the least-recently-used eviction order on crafted routings, refusals.
On the CPU with host_device == device: the code path of CUDA without the copy stream."""

import os

import pytest
import torch

from kimi3_testing import ROOT, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM, Kimi3ForConditionalGeneration, offload_experts, prepare_qat
from transformers_kimi3.expert_offload import ExpertCache
from transformers_kimi3.moe import Kimi3Experts
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")


def _packed():
    return Kimi3ForConditionalGeneration.from_pretrained(TINY).eval()


def _float():
    return tiny_model()


def _batch(vocab):
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def _run(model, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return logits, tokens


_REFERENCE = {}


@pytest.mark.parametrize("kind", ["packed", "float"])
@pytest.mark.parametrize("resident", [8, 4, 1])
def test_offloaded_model_equals_the_plain_model(kind, resident):
    make, vocab, cls, layers = {"packed": (_packed, 512, PackedMXFP4Experts, 7),
                                "float": (_float, 96, Kimi3Experts, 6)}[kind]
    ids, mask = _batch(vocab)
    if kind not in _REFERENCE:
        _REFERENCE[kind] = _run(make(), ids, mask)
    ref_logits, ref_tokens = _REFERENCE[kind]
    model = make()
    handle = offload_experts(model, "cpu", resident_experts=resident)
    assert model.expert_offload is handle and len(handle.caches) == layers and model.decode_cuda_graph is False
    assert all(type(c.experts) is cls and c.num_slots == resident for c in handle.caches.values())
    logits, tokens = _run(model, ids, mask)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    stats = handle.stats()
    assert all(s["steps"] == 5 and s["hits"] + s["misses"] > 0 for s in stats)  # the forward, prefill, 3 decode steps
    assert all(s["bytes_copied"] == s["misses"] * c.expert_bytes for s, c in zip(stats, handle.caches.values()))
    overflow = sum(s["overflow_steps"] for s in stats)
    # top-2 routes: one slot is fewer than any step needs; 4 slots hold a decode step of 2 rows (at most 4
    # experts) but not necessarily a prefill (the forward's and generate's); 8 hold every expert
    assert overflow == 0 if resident == 8 else overflow <= 2 * layers if resident == 4 else overflow == 5 * layers
    assert all(len(s["resident"]) <= resident for s in stats)
    most = max(s["misses"] for s in stats)  # above 8: an expert evicted and copied again
    assert most <= 8 if resident == 8 else most > 8 if resident == 1 else True


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_transformers_experts_implementations(implementation):
    """Float experts through Transformers' experts functions (they read the slot view's weights and expert count)."""
    ids, _ = _batch(96)
    plain, offloaded = tiny_model(), tiny_model()
    for m in (plain, offloaded):
        m.set_experts_implementation(implementation)
    offload_experts(offloaded, "cpu", resident_experts=3)
    with torch.no_grad():
        for x in (ids, ids[:, :1]):  # a prefill larger than the cache, then a step that fits
            assert torch.equal(offloaded(input_ids=x).logits, plain(input_ids=x).logits)


def _experts(E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    return PackedMXFP4Experts.from_float(w(E, 32, 32), w(E, 32, 32), w(E, 32, 32))


def _step(cache, experts, idx):
    """One step through the cache; its output equals the module's own."""
    idx = torch.tensor(idx)
    x = torch.randn(idx.shape[0], 32, generator=torch.Generator().manual_seed(int(idx.sum())))
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cache.fetch(idx)(x, idx, w), experts(x, idx, w))
    return cache.stats()


def test_hits_misses_and_bytes_on_a_crafted_routing():
    experts = _experts()
    cache = ExpertCache("layer", experts, torch.device("cpu"), 2)
    per_expert = 3 * (32 * 16 + 32 * 1)  # w1, w3, w2: [32, 32] as 16 bytes + 1 scale per row
    assert cache.expert_bytes == per_expert
    s = _step(cache, experts, [[0, 1], [1, 0]])
    assert (s["hits"], s["misses"], s["bytes_copied"], s["resident"]) == (0, 2, 2 * per_expert, [0, 1])
    s = _step(cache, experts, [[1, 2]])  # 1 hit; 2 replaces 0, the least recently used
    assert (s["hits"], s["misses"], s["resident"]) == (1, 3, [1, 2])
    s = _step(cache, experts, [[2, 2], [1, 2]])  # hits only: nothing copied
    assert (s["hits"], s["misses"], s["bytes_copied"], s["steps"]) == (3, 3, 3 * per_expert, 3)
    cache.reset_stats()
    assert (cache.stats()["hits"], cache.stats()["misses"], cache.stats()["resident"]) == (0, 0, [1, 2])


def test_least_recently_used_is_evicted_and_needed_experts_stay():
    experts = _experts()
    cache = ExpertCache("layer", experts, torch.device("cpu"), 3)
    _step(cache, experts, [[0, 1], [2, 0]])
    _step(cache, experts, [[0]])  # 0 used again
    assert _step(cache, experts, [[3]])["resident"] == [0, 2, 3]  # 1 and 2 tie (step 1): the lower slot goes
    assert _step(cache, experts, [[4]])["resident"] == [0, 3, 4]
    assert _step(cache, experts, [[5]])["resident"] == [3, 4, 5]
    assert _step(cache, experts, [[3, 0], [4, 0]])["resident"] == [0, 3, 4]  # 5, the only one not needed, goes
    assert cache.expert_of[cache.slot_of[0]] == 0


def test_a_step_with_more_experts_than_slots():
    experts = _experts()
    cache = ExpertCache("layer", experts, torch.device("cpu"), 2)
    _step(cache, experts, [[0, 5]])
    # 0: 1 route (hit), 1: 3 routes, 2: 2, 3: 1, 4: 1; slot of 5 (not needed) takes 1, the miss with most routes
    s = _step(cache, experts, [[0, 1], [1, 2], [1, 3], [2, 4]])
    assert (s["overflow_steps"], s["hits"], s["misses"], s["resident"]) == (1, 1, 6, [0, 1])
    s = _step(cache, experts, [[1, 0]])
    assert (s["overflow_steps"], s["hits"], s["misses"]) == (1, 3, 6)


def test_refusals():
    model = tiny_model()
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match=r"resident_experts must be an integer in \[1, 8\]"):
            offload_experts(model, "cpu", resident_experts=bad)
    offload_experts(model, "cpu", resident_experts=2)
    with pytest.raises(ValueError, match="offloaded already"):
        offload_experts(model, "cpu", resident_experts=2)
    with pytest.raises(TypeError, match="layers.1.block_sparse_moe.experts is QATExperts"):
        offload_experts(prepare_qat(tiny_model()), "cpu", resident_experts=2)
    dense = Kimi3ForCausalLM(tiny_k3_text_config(first_k_dense_replace=7))
    with pytest.raises(ValueError, match="no routed experts"):
        offload_experts(dense, "cpu", resident_experts=1)
