"""Expert offloading on CUDA (fp32): routed experts in pinned host memory, copies on the copy stream, the slot cache on
the GPU. Logits of a left-padded batch and greedy tokens (dynamic and static cache) equal the all-on-GPU model's,
for packed MXFP4 experts (the bundled checkpoint) and float experts, with 8, 4 and 1 of 8 experts resident."""

import os

import pytest
import torch

from kimi3_testing import ROOT, tiny_model
from transformers_kimi3 import Kimi3ForConditionalGeneration, offload_experts

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")
GREEDY = dict(do_sample=False, max_new_tokens=6)


def _make(kind):
    if kind == "packed":
        return Kimi3ForConditionalGeneration.from_pretrained(TINY).eval(), 512
    return tiny_model(), 96


@pytest.mark.parametrize("kind", ["packed", "float"])
@pytest.mark.parametrize("resident", [8, 4, 1])
def test_offloaded_model_on_cuda_equals_the_all_on_gpu_model(kind, resident, record):
    plain, vocab = _make(kind)
    plain = plain.cuda()
    model, _ = _make(kind)
    offload = offload_experts(model, "cuda", resident_experts=resident)
    cache = next(iter(offload.caches.values()))
    assert offload.pinned and all(t.is_pinned() for t in cache.host.values())
    assert all(t.is_cuda for t in cache.slots.values()) and cache.copy_stream is not None
    ids = torch.randint(3, vocab, (2, 11), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask).logits for m in (plain, model))
        record(f"{kind}, {resident} resident: logits differing from all-on-GPU", float((want != got).sum()), 0.5)
        for extra in ({}, {"cache_implementation": "static"}):
            want, got = (m.generate(input_ids=ids, attention_mask=mask, **GREEDY, **extra) for m in (plain, model))
            record(f"{kind}, {resident} resident, {extra or 'dynamic cache'}: tokens differing",
                   float((want != got).sum()), 0.5)
    stats = offload.stats()
    assert all(s["bytes_copied"] == s["misses"] * cache.expert_bytes for s in stats)
    assert sum(s["overflow_steps"] for s in stats) == 0 if resident == 8 else True
