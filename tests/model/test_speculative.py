"""Speculative decoding on the hybrid model (Transformers' assisted decoding: prompt lookup, a draft model, early exit)
and the cache operations behind it and behind prefix reuse: crop (KDA states rerun from a kept state), checkpoint,
copy, batch_repeat_interleave. Greedy speculative decoding returns plain greedy's tokens exactly; speculative sampling
keeps the sampling distribution."""

import copy
import math
import os

import numpy as np
import pytest
import torch

from kimi3_testing import ROOT, rel_err, tiny_model
from transformers_kimi3 import Kimi3Cache

TOL = 5e-5  # fp32: the recurrence rerun on a crop against a fresh prefill (chunked), as in test_cache_generation
LAC = dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True)
CONFIGS = {  # small stacks: every layer kind, with and without MLA, KDA and AttnRes
    "k3": dict(num_hidden_layers=4, attn_res_block_size=2,
               linear_attn_config=dict(LAC, kda_layers=[1, 2, 4], full_attn_layers=[3])),
    "kda_only": dict(num_hidden_layers=3, attn_res_block_size=2,
                     linear_attn_config=dict(LAC, kda_layers=[1, 2, 3], full_attn_layers=[])),
    "kimi_linear": dict(num_hidden_layers=3, attn_res_block_size=None,
                        linear_attn_config=dict(LAC, kda_layers=[1, 3], full_attn_layers=[2])),
    "mla_only": dict(num_hidden_layers=2, attn_res_block_size=None,
                     linear_attn_config=dict(LAC, kda_layers=[], full_attn_layers=[1, 2])),
}
GREEDY = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models: thread hand-offs cost more than the work, and much more on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rollbacks(monkeypatch):
    """The number of positions every crop removed (0s left out): proof that rejected candidates were rolled back."""
    removed = []
    crop = Kimi3Cache.crop

    def spy(self, max_length):
        if max_length < 0:
            removed.append(-max_length)
        return crop(self, max_length)

    monkeypatch.setattr(Kimi3Cache, "crop", spy)
    return removed


def ids(T, seed=0, high=96):
    return torch.randint(3, high, (1, T), generator=torch.Generator().manual_seed(seed))


def repetitive(T=10, seed=0):
    x = ids(T, seed)
    return torch.cat([x, x], 1)  # prompt lookup finds candidates


# ---------------------------------------------------------------------------------------------------------------
# greedy: token for token what plain greedy decoding returns


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_lookup_and_a_draft_model_return_plain_greedy_tokens(name, rollbacks):
    model, draft = tiny_model(seed=0, **CONFIGS[name]), tiny_model(seed=1, **CONFIGS[name])
    x = repetitive()
    with torch.no_grad():
        ref = model.generate(x, max_new_tokens=12, **GREEDY)
        lookup = model.generate(x, max_new_tokens=12, prompt_lookup_num_tokens=4, **GREEDY)
        n_lookup = len(rollbacks)
        assisted = model.generate(x, max_new_tokens=12, assistant_model=draft, **GREEDY)
    assert torch.equal(lookup, ref) and torch.equal(assisted, ref)
    # rejected candidates were rolled back, in the target's cache and in the draft's (a Kimi3 model too)
    assert n_lookup > 0 and len(rollbacks) > n_lookup + 5


def test_a_perfect_draft_and_continuing_from_the_returned_cache(rollbacks):
    """The model as its own draft accepts every candidate (long accepted runs, no rollback); the cache the call
    returns continues the conversation exactly, with or without speculation, and no longer records."""
    model = tiny_model(seed=2, **CONFIGS["k3"])
    x, more = repetitive(seed=3), ids(5, seed=4)
    with torch.no_grad():
        plain = model.generate(x, max_new_tokens=10, return_dict_in_generate=True, **GREEDY)
        turn2 = torch.cat([plain.sequences, more], 1)
        plain2 = model.generate(turn2, past_key_values=plain.past_key_values, max_new_tokens=8, **GREEDY)
        spec = model.generate(x, max_new_tokens=10, assistant_model=model, return_dict_in_generate=True, **GREEDY)
        assert not rollbacks and not spec.past_key_values.record_past
        spec2 = model.generate(turn2, past_key_values=spec.past_key_values, max_new_tokens=8,
                               prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(spec.sequences, plain.sequences) and torch.equal(spec2, plain2)


def test_early_exit_draft_runs_the_first_layers(monkeypatch):
    from transformers_kimi3.modeling_kimi3 import Kimi3DecoderLayer

    model = tiny_model(seed=5, **CONFIGS["k3"])
    calls = []
    forward = Kimi3DecoderLayer.forward
    monkeypatch.setattr(Kimi3DecoderLayer, "forward", lambda self, *a, **k: calls.append(self.layer_idx) or
                        forward(self, *a, **k))
    x = repetitive(seed=6)
    with torch.no_grad():
        ref = model.generate(x, max_new_tokens=10, **GREEDY)
        calls.clear()
        got = model.generate(x, max_new_tokens=10, assistant_early_exit=2, **GREEDY)
    assert torch.equal(got, ref)
    assert calls.count(0) > calls.count(3) > 0 and model.config.num_hidden_layers == 4


def test_any_causal_lm_with_the_same_vocabulary_can_draft(rollbacks):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(seed=7, **CONFIGS["kimi_linear"])
    torch.manual_seed(0)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2)).eval()
    x = repetitive(seed=8)
    with torch.no_grad():
        ref = model.generate(x, max_new_tokens=10, **GREEDY)
        got = model.generate(x, max_new_tokens=10, assistant_model=draft, **GREEDY)
    assert torch.equal(got, ref) and rollbacks


def test_a_left_padded_prompt(rollbacks):
    # Transformers' assisted decoding takes one row; its attention mask may still hold padding
    model, draft = tiny_model(seed=9, **CONFIGS["k3"]), tiny_model(seed=10, **CONFIGS["k3"])
    x = torch.cat([torch.zeros(1, 4, dtype=torch.long), repetitive(seed=11)], 1)
    mask = (torch.arange(x.shape[1]) >= 4).long()[None]
    with torch.no_grad():
        ref = model.generate(repetitive(seed=11), max_new_tokens=8, **GREEDY)[:, -8:]
        lookup = model.generate(x, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=3, **GREEDY)
        assisted = model.generate(x, attention_mask=mask, max_new_tokens=8, assistant_model=draft, **GREEDY)
    assert torch.equal(lookup[:, -8:], ref) and torch.equal(assisted[:, -8:], ref) and rollbacks


def test_unsupported_combinations_are_refused_by_name():
    model = tiny_model(seed=0, **CONFIGS["kimi_linear"])
    x = repetitive()
    with pytest.raises(ValueError, match="one sequence at a time.*input_ids has 2 rows"):
        model.generate(x.repeat(2, 1), max_new_tokens=4, prompt_lookup_num_tokens=3, **GREEDY)
    with pytest.raises(ValueError, match="dynamic cache.*cache_implementation='static'"):
        model.generate(x, max_new_tokens=4, prompt_lookup_num_tokens=3, cache_implementation="static", **GREEDY)


# ---------------------------------------------------------------------------------------------------------------
# images: the bundled K3 checkpoint (vision tower, one image)

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")


@pytest.fixture(scope="module")
def vlm():
    from transformers import AutoModelForCausalLM, AutoProcessor

    import transformers_kimi3  # noqa: F401  registers kimi_k3

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    y, x = np.mgrid[0:28, 0:42]
    image = np.stack([x * 5, y * 2, (x * y) % 255], -1).astype(np.uint8)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]
    inputs = AutoProcessor.from_pretrained(TINY).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    keep = 40  # the image turn without the long system prompt: a shorter test
    inputs["input_ids"], inputs["attention_mask"] = inputs["input_ids"][:, -keep:], inputs["attention_mask"][:, -keep:]
    assert int((inputs["input_ids"] == model.config.media_placeholder_token_id).sum()) == 1
    return model, dict(inputs)


def test_images_in_the_prompt(vlm, rollbacks):
    model, inputs = vlm
    draft = copy.deepcopy(model)  # the same kind of model with another head: it disagrees now and then
    with torch.no_grad():
        draft.language_model.lm_head.weight.add_(torch.randn_like(draft.language_model.lm_head.weight),
                                                 alpha=0.5 * float(draft.language_model.lm_head.weight.std()))
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=511)
        ref = model.generate(**inputs, **kw)
        lookup = model.generate(**inputs, prompt_lookup_num_tokens=3, **kw)
        n = len(rollbacks)
        assisted = model.generate(**inputs, assistant_model=draft, **kw)  # both caches hold the image
        assert len(rollbacks) > n
        text_draft = model.generate(**inputs, assistant_model=draft.language_model, **kw)  # reads no pixels
    assert torch.equal(lookup, ref) and torch.equal(assisted, ref) and torch.equal(text_draft, ref)


def test_crop_stays_out_of_the_expanded_image(vlm):
    model, inputs = vlm
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
    n_ids = inputs["input_ids"].shape[1]
    assert cache.get_seq_length() == n_ids < cache.seen_tokens  # input ids, not positions
    image_at = int((inputs["input_ids"][0] == model.config.media_placeholder_token_id).nonzero())
    with pytest.raises(ValueError, match=r"crop\(max_length=%d\).*inside the media" % (image_at + 1)):
        cache.crop(image_at + 1)
    assert cache.get_seq_length() == n_ids  # a refused crop changes nothing
    mla = cache.latents[model.config.text_config.layer_types.index("full_attention")]
    cache.crop(0)  # recording nothing, the cache can still go back to where it is
    cache.crop(-0)
    assert cache.latents[model.config.text_config.layer_types.index("full_attention")] is mla


# ---------------------------------------------------------------------------------------------------------------
# sampling: speculative sampling (Transformers' acceptance rule, reached through the draft's logits) keeps the
# distribution plain sampling draws from


def micro(seed, scale):
    """Two layers (KDA, MLA), a five-token vocabulary, the head's rows of norm `scale`: distributions neither
    uniform nor one-hot."""
    model = tiny_model(seed=seed, vocab_size=5, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                       first_k_dense_replace=2, attn_res_block_size=None, num_attention_heads=1, q_lora_rank=None,
                       kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       linear_attn_config=dict(LAC, num_heads=1, head_dim=8, short_conv_kernel_size=2,
                                               kda_layers=[1], full_attn_layers=[2]))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale / model.lm_head.weight.norm(dim=1, keepdim=True))
    return model


def two_step_distribution(model, prompt, eos):
    """The exact joint distribution [V, V] of the first two sampled tokens, EOS masked (min_new_tokens=2)."""
    with torch.no_grad():
        first = model(input_ids=prompt).logits[0, -1].double()
        first[eos] = -math.inf
        p1 = first.softmax(-1)
        V = p1.shape[0]
        both = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        second = model(input_ids=both).logits[:, -1].double()
        second[:, eos] = -math.inf
    return p1[:, None] * second.softmax(-1)


def chi_square_p(counts, probs):
    """Pearson's chi-square test p-value of counts against probs, cells expecting fewer than 5 draws pooled into one
    (a draw in a cell of probability 0 gives 0): the chi-square survival function, the regularised upper incomplete
    gamma function Q(dof / 2, stat / 2)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    n = counts.sum()
    big = n * probs >= 5
    counts = torch.cat([counts[big], counts[~big].sum()[None]])
    probs = torch.cat([probs[big], probs[~big].sum()[None]])
    stat = ((counts - n * probs) ** 2 / (n * probs)).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), stat / 2))


def test_speculative_sampling_keeps_the_sampling_distribution(rollbacks):
    model, draft = micro(2, scale=1.0), micro(3, scale=1.0)
    eos, prompt = model.config.eos_token_id, torch.tensor([[3]])
    p = two_step_distribution(model, prompt, eos)
    q = two_step_distribution(draft, prompt, eos)
    assert 0.5 * float((p - q).abs().sum()) > 0.3  # the draft proposes from quite another distribution
    counts = torch.zeros_like(p)
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(150):
            out = model.generate(prompt, assistant_model=draft, do_sample=True, max_new_tokens=2, min_new_tokens=2,
                                 pad_token_id=0)
            counts[out[0, 1], out[0, 2]] += 1
    assert len(rollbacks) > 30  # rejected draft tokens: the second token came after a rollback
    assert chi_square_p(counts, p) > 1e-3
    assert chi_square_p(counts, q) < 1e-9  # the test tells the two apart


# ---------------------------------------------------------------------------------------------------------------
# the cache: crop, checkpoint, copy, batch_repeat_interleave


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=12, **CONFIGS["k3"])


def states(cache):
    return [t for i, c in enumerate(cache.conv_states) if c is not None
            for t in c + (cache.recurrent_states[i],)] + [t for t in cache.latents if t is not None]


def prefilled(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=True).past_key_values


def test_crop_while_recording_reruns_the_kda_recurrence(model):
    x = ids(24, seed=13)
    with torch.no_grad():
        cache = prefilled(model, x[:, :10])
        cache.activate_past_recording()
        model(input_ids=x[:, 10:15], past_key_values=cache)  # a verification of 5 tokens
        model(input_ids=x[:, 15:16], past_key_values=cache)  # and a decode step
        for keep in (15, 12, 10):  # inside the 5-token forward, then the rollback base itself
            rolled = cache.copy()
            rolled.crop(keep - 16)
            ref = prefilled(model, x[:, :keep])
            assert rolled.get_seq_length() == rolled.seen_tokens == keep
            assert all(rel_err(a, b) < TOL for a, b in zip(states(rolled), states(ref)))
        model(input_ids=x[:, 10:13], past_key_values=rolled)  # recorded again from the crop (position 10)
        rolled.crop(-2)
        got = model(input_ids=x[:, 11:20], past_key_values=rolled).logits
        full = model(input_ids=x[:, :20]).logits[:, 11:]
    assert rel_err(got, full) < TOL


def test_crop_refuses_positions_it_cannot_reach(model):
    x = ids(20, seed=14)
    with torch.no_grad():
        cache = prefilled(model, x[:, :12])
        before = [t.clone() for t in states(cache)]
        with pytest.raises(ValueError, match=r"crop\(max_length=-1\): no KDA state at position 11.*checkpoints"):
            cache.crop(-1)  # not recording: the KDA state of position 11 is gone
        with pytest.raises(ValueError, match=r"crop\(max_length=13\).*between 0 and 12"):
            cache.crop(13)
        assert all(torch.equal(a, b) for a, b in zip(states(cache), before))
        cache.activate_past_recording(window=4)
        model(input_ids=x[:, 12:14], past_key_values=cache)
        model(input_ids=x[:, 14:17], past_key_values=cache)  # 5 > 4 positions: the record restarts at 14
        with pytest.raises(ValueError, match="reachable are positions 14..17"):
            cache.crop(13)
        cache.crop(14)
        cache.crop(-14)  # back to nothing: zeros
        assert cache.get_seq_length() == 0 and all(float(t.abs().max()) == 0 for t in states(cache) if t.numel())


def test_checkpoint_copy_and_batch_repeat_interleave_for_a_shared_prefix(model):
    prefix, qa, qb = ids(14, seed=15), ids(4, seed=16), ids(4, seed=17)
    kw = dict(max_new_tokens=5, **GREEDY)
    with torch.no_grad():
        ref_a = model.generate(torch.cat([prefix, qa], 1), **kw)
        ref_b = model.generate(torch.cat([prefix, qb], 1), **kw)
        cache = prefilled(model, prefix)
        n = cache.checkpoint()
        other = cache.copy()
        got_a = model.generate(torch.cat([prefix, qa], 1), past_key_values=cache, **kw)
        cache.crop(n)  # back to the end of the prefix, however far the answer went
        got_b = model.generate(torch.cat([prefix, qb], 1), past_key_values=cache, **kw)
        got_b2 = model.generate(torch.cat([prefix, qb], 1), past_key_values=other, **kw)  # the copy was untouched
        both = cache.copy()
        both.crop(n)
        both.batch_repeat_interleave(2)  # one prefix, two continuations in one batch
        got_ab = model.generate(torch.cat([prefix.repeat(2, 1), torch.cat([qa, qb])], 1), past_key_values=both, **kw)
    assert torch.equal(got_a, ref_a) and torch.equal(got_b, ref_b) and torch.equal(got_b2, ref_b)
    assert torch.equal(got_ab, torch.cat([ref_a, ref_b]))
    assert both.checkpoints[n]["recurrent"][0].shape[0] == 2  # checkpoints follow the rows too


def test_copies_share_the_model_parameters_a_record_reruns_with(model):
    with torch.no_grad():
        cache = prefilled(model, ids(8, seed=18))
        cache.activate_past_recording()
        model(input_ids=ids(3, seed=19), past_key_values=cache)
    twin = copy.deepcopy(cache)
    assert twin._records[0]["gate"][0] is model.model.layers[0].self_attn.A_log
    assert twin._records[0]["recurrent"] is not cache._records[0]["recurrent"]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(states(twin), states(cache)))


def test_static_cache_crops_in_place(model):
    x = ids(16, seed=20)
    cache = Kimi3Cache(model.config, max_length=32)
    with torch.no_grad():
        model(input_ids=x[:, :9], past_key_values=cache)
        n = cache.checkpoint()
        addresses, version = [t.data_ptr() for t in states(cache)], cache.storage_version
        model(input_ids=x[:, 9:13], past_key_values=cache)
        cache.crop(n)
        assert [t.data_ptr() for t in states(cache)] == addresses and cache.storage_version == version
        got = model(input_ids=x[:, 9:16], past_key_values=cache).logits
        full = model(input_ids=x).logits[:, 9:]
    assert rel_err(got, full) < TOL
