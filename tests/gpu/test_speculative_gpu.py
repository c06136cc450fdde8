"""Speculative decoding on CUDA (fp32, our Triton KDA kernels): prompt lookup and a Kimi3 draft model, at batch 1
and on a left-padded batch of 2, on the dynamic cache (eager steps; each round's rollback reruns the recurrent kernel
with the dropped positions' gates at -inf) and on the static cache (every step shape recorded once as a CUDA graph and
replayed: the verification of k + 1 tokens, plain steps, the draft's steps). Each returns the tokens of plain greedy
decoding with the static cache on the same GPU, which equal the CPU's."""

import pytest
import torch

from kimi3_testing import tiny_model

LAC = dict(num_heads=2, head_dim=32, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
           kda_layers=[1, 2, 4], full_attn_layers=[3])
CONFIG = dict(num_hidden_layers=4, attn_res_block_size=2, linear_attn_config=LAC)
GREEDY = dict(do_sample=False, pad_token_id=0, max_new_tokens=24)
DRAFT = dict(num_assistant_tokens=4, assistant_confidence_threshold=0.0)
_MODELS = {}


def models():
    """(target on CPU, target on CUDA, draft on CUDA), fp32."""
    if not _MODELS:
        cpu = tiny_model(seed=0, **CONFIG)
        _MODELS["m"] = (cpu, tiny_model(seed=0, **CONFIG).cuda(), tiny_model(seed=1, **CONFIG).cuda())
    return _MODELS["m"]


def prompts(batch):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 96, (n,), generator=g) for n in (12, 7)[:batch]]
    rows = [torch.cat([r, r, r[:3]]) for r in rows]  # repeated text: prompt lookup finds candidates
    T = max(len(r) for r in rows)
    ids, mask = torch.zeros(batch, T, dtype=torch.long), torch.zeros(batch, T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):], mask[b, T - len(r):] = r, 1
    return ids, mask


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("kind", ["prompt_lookup", "draft"])
def test_speculation_on_cuda_returns_plain_greedy_tokens(kind, cache, batch, record):
    cpu, gpu, draft = models()
    ids, mask = prompts(batch)
    extra = dict(prompt_lookup_num_tokens=4) if kind == "prompt_lookup" else dict(DRAFT, assistant_model=draft)
    if cache == "static":
        extra["cache_implementation"] = "static"
    gpu.release_static_caches()
    draft.release_static_caches()
    with torch.no_grad():
        want = cpu.generate(ids, attention_mask=mask, **GREEDY)
        plain = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), cache_implementation="static", **GREEDY)
        got = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), **GREEDY, **extra)
    assert torch.equal(plain.cpu(), want)
    record(f"{kind}, {cache} cache, batch {batch}: tokens differing from plain greedy",
           float((got.cpu() != want).sum()), 0.5)
    if cache == "static":  # the verification of k + 1 tokens ran as a replayed graph
        (graphs,) = gpu._static_pool().step_graphs.values()
        assert (5, True) in graphs
        if kind == "draft":
            (steps,) = draft._static_pool().step_graphs.values()
            assert {(1, True), (2, True)} <= set(steps)


def test_speculative_sampling_on_cuda_graphs(record):
    """Sampling on the static cache at batch 64 with a draft: runs, and the first token's distribution matches plain
    sampling's (total variation of the empirical frequencies, 64 x 8 draws, within a loose bound)."""
    _, gpu, draft = models()
    prompt = torch.tensor([[5, 9, 11]], device="cuda").repeat(64, 1)
    kw = dict(do_sample=True, max_new_tokens=3, pad_token_id=0, top_k=0)
    torch.manual_seed(0)
    with torch.no_grad():
        p = gpu(input_ids=prompt[:1]).logits[0, -1].float().softmax(-1)
        first = torch.cat([gpu.generate(prompt, assistant_model=draft, cache_implementation="static", **DRAFT,
                                        **kw)[:, 3] for _ in range(8)])
    freq = torch.bincount(first, minlength=p.shape[0]).float() / first.numel()
    record("speculative sampling on CUDA graphs: total variation of the first token's frequencies",
           0.5 * float((freq - p).abs().sum()), 0.3)
