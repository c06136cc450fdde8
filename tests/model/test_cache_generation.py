"""The hybrid cache: cache vs no cache, chunked prefill vs one pass, left padding vs no padding, batch vs single,
models without MLA layers, and the generate() modes."""

import copy
import gc

import pytest
import torch

from kimi3_testing import rel_err, tiny_model
from transformers_kimi3 import Kimi3Cache

TOL = 5e-5  # fp32 rounding of the same math in another order (chunked vs recurrent KDA); a bug gives > 1e-2


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def ids(B, T, seed=0):
    return torch.randint(3, 96, (B, T), generator=torch.Generator().manual_seed(seed))


def test_cached_decoding_equals_full_recompute(model):
    x = ids(2, 23)
    with torch.no_grad():
        full = model(input_ids=x, use_cache=False).logits
        out = model(input_ids=x[:, :15], use_cache=True)
        cache = out.past_key_values
        assert isinstance(cache, Kimi3Cache) and cache.get_seq_length() == 15
        steps = [out.logits]
        for t in range(15, 23):  # one token at a time: the recurrent KDA path
            steps.append(model(input_ids=x[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert rel_err(torch.cat(steps, 1), full) < TOL


@pytest.mark.parametrize("chunks", [[64, 6], [1, 40, 29], [3, 3, 3, 61]])
def test_chunked_prefill_equals_one_pass(model, chunks):
    x = ids(2, 70, seed=1)
    with torch.no_grad():
        full = model(input_ids=x, use_cache=False).logits
        cache, outs, start = None, [], 0
        for n in chunks:
            out = model(input_ids=x[:, start:start + n], past_key_values=cache, use_cache=True)
            cache, start = out.past_key_values, start + n
            outs.append(out.logits)
    assert rel_err(torch.cat(outs, 1), full) < TOL


@pytest.mark.parametrize("block", [7, 16])
def test_chunked_prefill_over_key_blocks(model, monkeypatch, block):
    # a chunk over a long cache attends the cached prefix in blocks merged by log-sum-exp (bounded memory):
    # block 7 splits the prefix unevenly, and the 40-token chunk sees more than 2 blocks
    from transformers_kimi3.mla import Kimi3MLAAttention

    monkeypatch.setattr(Kimi3MLAAttention, "KEY_BLOCK", block)
    calls = []
    blockwise = Kimi3MLAAttention._blockwise
    monkeypatch.setattr(Kimi3MLAAttention, "_blockwise", lambda self, *a: calls.append(1) or blockwise(self, *a))
    x = ids(2, 70, seed=4)
    with torch.no_grad():
        full = model(input_ids=x, use_cache=False).logits
        cache, outs, start = None, [], 0
        for n in [20, 40, 10]:
            out = model(input_ids=x[:, start:start + n], past_key_values=cache, use_cache=True)
            cache, start = out.past_key_values, start + n
            outs.append(out.logits)
    assert calls and rel_err(torch.cat(outs, 1), full) < TOL


def test_left_padding_is_exact(model):
    long, short = ids(1, 30, seed=2), ids(1, 19, seed=3)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 11, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :11] = 0
    with torch.no_grad():
        got = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
        ref_long = model(input_ids=long, use_cache=False).logits
        ref_short = model(input_ids=short, use_cache=False).logits
    assert rel_err(got[0], ref_long[0]) < TOL
    assert rel_err(got[1, 11:], ref_short[0]) < TOL
    # and through generation with a cache
    with torch.no_grad():
        gen = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        gen_short = model.generate(short, max_new_tokens=6, do_sample=False, pad_token_id=0)
        gen_long = model.generate(long, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen[1, -6:], gen_short[0, -6:])
    assert torch.equal(gen[0, -6:], gen_long[0, -6:])


def test_padding_plan_is_built_once_per_forward(model, monkeypatch):
    # Every KDA layer of a forward gets the same mask, and building the packing plan reads it on the host (a stream
    # wait on GPUs): one plan per forward, reused by every layer, rebuilt when the mask changes in place.
    from transformers_kimi3 import kda
    plans = []
    real = kda.packing
    monkeypatch.setattr(kda, "packing", lambda mask, seq_idx: plans.append(real(mask, seq_idx)) or plans[-1])
    n_kda = sum(isinstance(m, kda.Kimi3DeltaAttention) for m in model.modules())
    batch = ids(2, 30, seed=5)
    mask = torch.ones_like(batch)
    mask[1, :11] = 0
    with torch.no_grad():
        first = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
        assert len(plans) == n_kda > 1 and all(p is plans[0] for p in plans)
        assert plans[0][1].tolist() == [0, 30, 49] and plans[0][0].numel() == 49
        mask[1, :11] = 1
        mask[0, :4] = 0
        second = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
        ref = model(input_ids=batch[:1, 4:], use_cache=False).logits
    assert plans[-1] is not plans[0] and plans[-1][1].tolist() == [0, 26, 56]
    assert rel_err(second[0, 4:], ref[0]) < TOL and rel_err(second[1], first[1]) > 1e-3


def test_kda_layers_see_no_mask_once_the_new_tokens_are_all_valid(model, monkeypatch):
    # a left-padded batch: its prefill hands the KDA layers the mask; its decode steps (new tokens are never padding)
    # hand them None, checked once per forward instead of once per layer (each check waits for the GPU)
    from transformers_kimi3 import kda
    seen = []
    forward = kda.Kimi3DeltaAttention.forward
    monkeypatch.setattr(kda.Kimi3DeltaAttention, "forward",
                        lambda self, x, attention_mask=None, **kw: seen.append(attention_mask) or
                        forward(self, x, attention_mask=attention_mask, **kw))
    batch = ids(2, 12, seed=6)
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    with torch.no_grad():
        out = model(input_ids=batch, attention_mask=mask, use_cache=True)
        assert seen and all(m is not None for m in seen)
        seen.clear()
        nxt = out.logits[:, -1:].argmax(-1)
        step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                     past_key_values=out.past_key_values, use_cache=True).logits
        assert seen and all(m is None for m in seen)
        full = model(input_ids=torch.cat([batch, nxt], 1), attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                     use_cache=False).logits
    assert rel_err(step[:, -1], full[:, -1]) < TOL


def test_generate_logits_match_manual_loop(model):
    x = ids(1, 12, seed=4)
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        seq = out.sequences
        full = model(input_ids=seq[:, :-1], use_cache=False).logits
    steps = torch.stack(out.logits, 1)
    assert rel_err(steps, full[:, 11:]) < TOL


def test_model_without_mla_layers_generates():
    # The native Kimi Linear breaks here (get_seq_length raises without an attention layer).
    kda_only = tiny_model(num_hidden_layers=4, linear_attn_config=dict(
        num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
        kda_layers=[1, 2, 3, 4], full_attn_layers=[]))
    x = ids(2, 9, seed=5)
    with torch.no_grad():
        gen = kda_only.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
        full = kda_only(input_ids=gen[:, :-1], use_cache=False).logits
    assert torch.equal(full[:, 8:].argmax(-1), gen[:, 9:])


def test_sampling_and_beam_search_run(model):
    x = ids(2, 8, seed=6)
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = model.generate(x, max_new_tokens=4, do_sample=True, top_k=5, pad_token_id=0)
        beams = model.generate(x, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
    assert sampled.shape == (2, 12)
    assert beams.sequences.shape == (2, 12)
    # the best beam's score equals a fresh forward over the chosen continuation (cache reordering is right)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=beams.sequences, use_cache=False).logits.float(), -1)
    chosen = logp[:, 7:-1].gather(-1, beams.sequences[:, 8:, None])[..., 0].sum(-1)
    assert torch.allclose(chosen, beams.sequences_scores * 4, atol=1e-4)


def test_static_cache_gives_the_same_tokens_and_logits(model):
    x = ids(2, 11, seed=7)
    with torch.no_grad():
        dyn = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        sta = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, cache_implementation="static")
    assert torch.equal(dyn.sequences, sta.sequences)
    assert rel_err(torch.stack(sta.logits), torch.stack(dyn.logits)) < TOL
    cache = Kimi3Cache(model.config, max_length=4)
    with torch.no_grad():
        model(input_ids=x[:, :3], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="static cache holds 4 positions"):
            model(input_ids=x[:, 3:5], past_key_values=cache, use_cache=True)


def _hf_loop(model, *args, **kw):
    model.fast_static_greedy = False
    try:
        return model.generate(*args, **kw)
    finally:
        model.fast_static_greedy = True


@pytest.fixture
def fast_loop_calls(monkeypatch):
    """A list that grows by one each time generate() takes our static greedy loop."""
    from transformers_kimi3.generation import Kimi3GenerationMixin

    calls = []
    fast = Kimi3GenerationMixin._static_greedy
    monkeypatch.setattr(Kimi3GenerationMixin, "_static_greedy", lambda *a: calls.append(1) or fast(*a))
    return calls


def test_static_greedy_loop_equals_transformers_loop(model, fast_loop_calls):
    # plain greedy + static cache takes our loop (no per-step host sync); it must return exactly what
    # Transformers' loop returns, EOS handling included. EOS ids are picked from the free-running output so that
    # row 0 finishes first (then pads) and, in the second case, every row finishes before max_new_tokens.
    calls = fast_loop_calls
    x = ids(3, 9, seed=9)
    with torch.no_grad():
        free = model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert calls == [] and free.shape == (3, 21)  # dynamic cache: Transformers' loop
        cases = [dict(eos_token_id=int(free[0, 12])),  # row 0 stops at step 4
                 dict(eos_token_id=[int(free[r, 9 + 5 + r]) for r in range(3)], pad_token_id=1),
                 dict(eos_token_id=int(free[0, 10]), min_new_tokens=3),  # EOS masked in the first 3 steps
                 dict(eos_token_id=[500, int(free[1, 11])], min_new_tokens=1),  # an id outside the vocabulary
                 dict(max_new_tokens=1)]
        for kw in cases:
            kw = {"max_new_tokens": 12, "pad_token_id": 0, **kw}
            want = _hf_loop(model, x, do_sample=False, cache_implementation="static", **kw)
            got = model.generate(x, do_sample=False, cache_implementation="static", **kw)
            assert torch.equal(got, want), kw
    assert len(calls) == len(cases)
    # anything the loop does not reproduce goes through Transformers: here a pad id inside the prompt (no mask)
    with torch.no_grad():
        model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=int(x[1, 0]),
                       cache_implementation="static")
        model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static",
                       repetition_penalty=1.3)
        model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static",
                       output_logits=True, return_dict_in_generate=True)
    assert len(calls) == len(cases)


def test_static_greedy_reuses_its_cache(model):
    # consecutive calls of the same batch size and length bucket share one static cache (and on CUDA its captured
    # graph): the reset cache must give exactly the tokens of a fresh one, whatever ran before
    x, y = ids(2, 9, seed=10), ids(2, 14, seed=11)
    with torch.no_grad():
        want_x = _hf_loop(model, x, max_new_tokens=7, do_sample=False, pad_token_id=0,
                          cache_implementation="static")
        want_y = _hf_loop(model, y, max_new_tokens=5, do_sample=False, pad_token_id=0,
                          cache_implementation="static")
        model.release_static_caches()
        got = [model.generate(z, max_new_tokens=n, do_sample=False, pad_token_id=0, cache_implementation="static")
               for z, n in ((x, 7), (y, 5), (x, 7))]
    pool = model._static_pool()
    assert len(pool.caches) == 1  # 16 and 19 positions: one 256-position bucket
    assert torch.equal(got[0], want_x) and torch.equal(got[1], want_y) and torch.equal(got[2], want_x)
    model.release_static_caches()
    assert model._static_pool() is not pool and not model._static_pool().caches


def test_generate_with_chunked_prefill(model):
    x = ids(2, 40, seed=8)
    with torch.no_grad():
        whole = model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True)
        chunked = model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True, prefill_chunk_size=16)
    assert torch.equal(whole.sequences, chunked.sequences)
    assert rel_err(torch.stack(chunked.logits), torch.stack(whole.logits)) < TOL


def test_static_greedy_with_chunked_prefill(model, fast_loop_calls):
    # long prompts at B>1 need both: the fast loop must take prefill_chunk_size, not hand it to Transformers' loop
    x = ids(2, 40, seed=9)
    with torch.no_grad():
        whole = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
        chunked = [model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static",
                                  prefill_chunk_size=c) for c in (7, 16, 64)]
    assert len(fast_loop_calls) == 3
    for got in chunked:
        assert torch.equal(got, whole)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_prefill_chunk_size_must_be_positive(model, bad):
    # a chunk of 0 or fewer tokens would prefill nothing and leave the fast loop without logits
    with pytest.raises(ValueError, match="prefill_chunk_size must be a positive"):
        model.generate(ids(1, 8), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="static",
                       prefill_chunk_size=bad)


# ---- decode steps replayed as CUDA graphs (decode_graphs.py). A CUDA graph needs a GPU; on the CPU the recording
# is replaced by one that keeps the step function: a replay runs it again, which is what a CUDA graph replays (the
# cache addressed by the graph's position tensor, the whole static buffer under the position mask). The
# bookkeeping around it (pool, warm-up undone from a snapshot, counters, re-recording, fallbacks) is the real code.


def test_recorded_decode_steps_equal_eager_decoding(model, recorded_steps, fast_loop_calls):
    x = ids(2, 9, seed=12)
    model.release_static_caches()
    with torch.no_grad():
        model.decode_cuda_graph = False  # Transformers' loop on a static cache, every step eager
        try:
            eager = _hf_loop(model, x, max_new_tokens=7, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, cache_implementation="static")
        finally:
            model.decode_cuda_graph = True
        assert recorded_steps == []
        # Transformers' loop on the static cache generate() builds: one recording, then replays
        hf = _hf_loop(model, x, max_new_tokens=7, do_sample=False, pad_token_id=0, output_logits=True,
                      return_dict_in_generate=True, cache_implementation="static")
        assert len(recorded_steps) == 1
        # our loop on a pooled cache: recorded at its first decode step, replayed by the next call (reset in place)
        got = [model.generate(x, max_new_tokens=7, do_sample=False, pad_token_id=0, cache_implementation="static")
               for _ in range(2)]
    assert len(recorded_steps) == 2 and len(fast_loop_calls) == 2
    assert torch.equal(hf.sequences, eager.sequences)
    assert rel_err(torch.stack(hf.logits), torch.stack(eager.logits)) < TOL
    assert torch.equal(got[0], eager.sequences) and torch.equal(got[1], eager.sequences)
    pool = model._static_pool()
    (cache,) = pool.caches.values()
    assert cache in pool.graphs and cache.position is None  # the device position is the graph's, not the cache's
    model.release_static_caches()


def test_decode_graph_follows_its_cache(model, recorded_steps):
    # a graph reads the cache's tensors at their recorded addresses: replacing them (here by reordering the batch)
    # records anew; a full cache decodes eagerly, which reports the overflow
    from transformers_kimi3.decode_graphs import graph_decodable

    x = ids(2, 6, seed=13)
    model.release_static_caches()
    cache = Kimi3Cache(model.config, max_length=9)
    with torch.no_grad():
        tok = model(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(2):
            tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits.argmax(-1)
        assert len(recorded_steps) == 1 and cache.seen_tokens == cache.source_tokens == 8
        version = cache.storage_version
        cache.reorder_cache(torch.tensor([1, 0]))
        assert cache.storage_version != version
        tok = model(input_ids=tok.flip(0), past_key_values=cache, use_cache=True).logits.argmax(-1)
        assert len(recorded_steps) == 2 and cache.seen_tokens == 9
        assert not graph_decodable(cache, tok, None, False, False)  # no room: the eager step raises
        with pytest.raises(ValueError, match="static cache holds 9 positions"):
            model(input_ids=tok, past_key_values=cache, use_cache=True)
    model.release_static_caches()


def test_graph_decodable_falls_back_to_eager_steps(model, recorded_steps):
    from transformers_kimi3.decode_graphs import graph_decodable

    static = Kimi3Cache(model.config, max_length=16)
    static.seen_tokens = 4
    one = torch.ones(2, 1, dtype=torch.long)
    assert graph_decodable(static, one, None, False, False) is False  # gradients are on outside no_grad
    with torch.no_grad():
        assert graph_decodable(static, one, None, False, False)
        assert not graph_decodable(Kimi3Cache(model.config), one, None, False, False)  # a growing cache
        assert not graph_decodable(static, torch.ones(2, 2, dtype=torch.long), None, False, False)  # 2 tokens
        assert not graph_decodable(static, None, None, False, False)  # inputs_embeds
        assert not graph_decodable(static, one, one, False, False)  # labels
        assert not graph_decodable(static, one, None, True, False)
        assert not graph_decodable(static, one, None, False, True)
        static.attention_mask = torch.ones(2, 4, dtype=torch.long)  # a padded batch
        assert not graph_decodable(static, one, None, False, False)
        static.attention_mask, static.seen_tokens = None, 0  # nothing prefilled yet
        assert not graph_decodable(static, one, None, False, False)


def test_static_cache_pool_keeps_caches_by_shape_and_graphs_by_cache(model):
    from transformers_kimi3.decode_graphs import StaticCachePool

    pool, cfg = StaticCachePool(), model.config
    a = pool.cache(cfg, 2, 19, "cpu", 0)
    assert a.max_length == 256 and pool.cache(cfg, 2, 256, "cpu", 0) is a
    assert pool.cache(cfg, 2, 257, "cpu", 0).max_length == 512  # another bucket
    assert pool.cache(cfg, 2, 19, "cpu", 1) is not a  # other weights: a third cache, the oldest goes
    assert len(pool.caches) == 2 and a not in pool.caches.values()
    b = pool.cache(cfg, 2, 19, "cpu", 1)
    with torch.no_grad():
        model(input_ids=ids(2, 5), past_key_values=b, use_cache=True)
    tensors = [t.data_ptr() for t in b._tensors()]
    pool.graphs[b] = "graph"
    assert pool.cache(cfg, 2, 19, "cpu", 1) is b and b.seen_tokens == 0
    assert [t.data_ptr() for t in b._tensors()] == tensors and all(not t.any() for t in b._tensors())
    del pool.graphs[b]
    version = b.storage_version
    assert pool.cache(cfg, 2, 19, "cpu", 1) is b and b.storage_version != version
    assert b.batch_size is None  # dropped: the next call allocates
    pool.graphs[a] = "graph"  # a graph goes with its cache
    del a
    gc.collect()
    assert len(pool.graphs) == 0
    assert not copy.deepcopy(pool).caches  # a copied model records its own graphs
