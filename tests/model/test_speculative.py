"""Speculative decoding on the hybrid model (speculative.py: prompt lookup, a draft model, early exit; batches with
left padding, each row its own accepted length; dynamic and static cache) and the cache operations behind it and
behind prefix reuse: speculation rounds (begin_round / keep_rows / compact), crop, checkpoint, copy,
batch_repeat_interleave. In fp32 on the CPU greedy speculative decoding returns exactly plain greedy's tokens (asserted
with torch.equal); speculative sampling keeps the sampling distribution (a chi-square test)."""

import contextlib
import copy
import math
import os

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kimi3_testing import ROOT, rel_err, tiny_model
from transformers_kimi3 import Kimi3Cache

TOL = 5e-5  # fp32: the recurrence rerun from a kept state against a fresh prefill (chunked), test_cache_generation's
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
DRAFT = dict(num_assistant_tokens=2, assistant_confidence_threshold=0.0)  # k drafted tokens every round


@pytest.fixture
def rollbacks(monkeypatch):
    """What every speculation round dropped: one list of per-row dropped positions per round that dropped any (proof
    that rejected candidates were rolled back; rows dropping different numbers are rows with their own accepted
    lengths). Transformers' loop (crop) adds [n]."""
    rounds = []
    keep_rows, crop = Kimi3Cache.keep_rows, Kimi3Cache.crop

    def spy_keep(self, counts, longest=None):
        n = self.seen_tokens - self._round["base"]
        dropped = [n - int(c) for c in counts]
        if any(dropped):
            rounds.append(dropped)
        return keep_rows(self, counts, longest)

    def spy_crop(self, max_length):
        if max_length < 0:
            rounds.append([-max_length])
        return crop(self, max_length)

    monkeypatch.setattr(Kimi3Cache, "keep_rows", spy_keep)
    monkeypatch.setattr(Kimi3Cache, "crop", spy_crop)
    return rounds


def ids(T, seed=0, high=96):
    return torch.randint(3, high, (1, T), generator=torch.Generator().manual_seed(seed))


def repetitive(T=10, seed=0):
    x = ids(T, seed)
    return torch.cat([x, x], 1)  # prompt lookup finds candidates


def left_padded(*rows, pad=0):
    """A left-padded batch and its attention mask from rows [1, T_i]."""
    T = max(r.shape[1] for r in rows)
    batch = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        batch[b, T - r.shape[1]:], mask[b, T - r.shape[1]:] = r[0], 1
    return batch, mask


# ---------------------------------------------------------------------------------------------------------------
# greedy: token for token what plain greedy decoding returns

MODES = {"lookup": dict(prompt_lookup_num_tokens=4), "lookup_static": dict(prompt_lookup_num_tokens=4,
                                                                           cache_implementation="static"),
         "draft": dict(), "draft_static": dict(cache_implementation="static")}


@pytest.mark.parametrize("name,modes", [("k3", ["lookup_static", "draft", "draft_static"]),
                                        ("kda_only", ["lookup", "draft"]), ("kimi_linear", ["lookup", "draft_static"]),
                                        ("mla_only", ["lookup_static", "draft"])])
def test_a_left_padded_batch_returns_plain_greedy_tokens(name, modes, rollbacks):
    """Two rows of different lengths, each accepting its own number of candidates per round: the rows' caches keep
    different numbers of positions (holes in the shorter one's mask), the KDA states are rerun per row, a Kimi3 draft's
    cache rolls back the same way; dynamic and static cache."""
    model, draft = tiny_model(seed=0, **CONFIGS[name]), tiny_model(seed=1, **CONFIGS[name])
    x, mask = left_padded(repetitive(seed=2), torch.cat([ids(4, seed=3), repetitive(T=4, seed=4)], 1)[:, :9])
    kw = dict(attention_mask=mask, max_new_tokens=8, **GREEDY)
    with torch.no_grad():
        ref = model.generate(x, **kw)
        for mode in modes:
            extra = dict(MODES[mode], **({} if "lookup" in mode else dict(DRAFT, assistant_model=draft)))
            assert torch.equal(model.generate(x, **kw, **extra), ref), mode
    assert rollbacks  # rejected candidates were rolled back
    if name == "k3":
        assert any(len(set(r)) > 1 for r in rollbacks)  # rows rolled back by different numbers of positions


def test_rows_finish_at_their_own_eos(rollbacks):
    # EOS ids picked from the free-running output so that the rows stop at different steps; min_new_tokens masks EOS
    model, draft = tiny_model(seed=0, **CONFIGS["k3"]), tiny_model(seed=1, **CONFIGS["k3"])
    x, mask = left_padded(repetitive(seed=5), repetitive(T=6, seed=6))
    with torch.no_grad():
        free = model.generate(x, attention_mask=mask, max_new_tokens=10, **GREEDY)[:, x.shape[1]:]
        eos = int(free[0, 3])
        # row 0 stops at its EOS (prompt lookup); then EOS masked where it would have stopped (a static draft)
        for extra, spec in (({}, dict(prompt_lookup_num_tokens=3)),
                            (dict(min_new_tokens=5), dict(DRAFT, assistant_model=draft, cache_implementation="static"))):
            kw = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=eos, **GREEDY, **extra)
            ref = model.generate(x, **kw)
            assert bool((ref[0, x.shape[1]:] == eos).any()) != bool(extra)  # row 0 stopped, or not
            assert torch.equal(model.generate(x, **kw, **spec), ref)


def test_a_perfect_draft_and_continuing_from_the_returned_cache(rollbacks):
    """The model as its own draft accepts every candidate (long accepted runs, no rollback); the cache the call
    returns continues the conversation exactly, with or without speculation."""
    model = tiny_model(seed=2, **CONFIGS["k3"])
    x, more = repetitive(seed=3), ids(5, seed=4)
    with torch.no_grad():
        plain = model.generate(x, max_new_tokens=10, return_dict_in_generate=True, **GREEDY)
        turn2 = torch.cat([plain.sequences, more], 1)
        plain2 = model.generate(turn2, past_key_values=plain.past_key_values, max_new_tokens=8, **GREEDY)
        spec = model.generate(x, max_new_tokens=10, assistant_model=model, return_dict_in_generate=True, **GREEDY)
        assert not rollbacks and not spec.past_key_values.in_round
        assert spec.past_key_values.get_seq_length() == spec.sequences.shape[1] - 1  # all but the last token
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
        got = model.generate(x, max_new_tokens=10, assistant_early_exit=2, **DRAFT, **GREEDY)
    assert torch.equal(got, ref)
    assert calls.count(0) > calls.count(3) > 0 and model.config.num_hidden_layers == 4


def test_any_causal_lm_with_the_same_vocabulary_can_draft(rollbacks):
    # a rotary model drafting a left-padded batch: its cache is cut to the longest row, holes go in its mask and its
    # position ids count each row's tokens
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(seed=7, **CONFIGS["kimi_linear"])
    torch.manual_seed(0)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2)).eval()
    x, mask = left_padded(repetitive(seed=8), repetitive(T=5, seed=9))
    with torch.no_grad():
        ref = model.generate(x, attention_mask=mask, max_new_tokens=10, **GREEDY)
        got = model.generate(x, attention_mask=mask, max_new_tokens=10, assistant_model=draft, **DRAFT, **GREEDY)
    assert torch.equal(got, ref) and rollbacks


def test_transformers_loop_takes_what_ours_does_not(rollbacks):
    """Options our loop does not reproduce run in Transformers' assisted decoding (one row, dynamic cache, crop()
    rolling the KDA states back); with a batch or the static cache they are refused by name."""
    model = tiny_model(seed=0, **CONFIGS["kimi_linear"])
    x = repetitive()
    kw = dict(max_new_tokens=8, repetition_penalty=1.3, **GREEDY)
    with torch.no_grad():
        ref = model.generate(x, **kw)
        got = model.generate(x, prompt_lookup_num_tokens=3, **kw)
    assert torch.equal(got, ref) and rollbacks
    with pytest.raises(ValueError, match="repetition_penalty.*one row on the dynamic cache"):
        model.generate(x.repeat(2, 1), prompt_lookup_num_tokens=3, **kw)
    with pytest.raises(ValueError, match="repetition_penalty.*one row on the dynamic cache"):
        model.generate(x, prompt_lookup_num_tokens=3, cache_implementation="static", **kw)
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(x, attention_mask=(torch.arange(20) < 18).long()[None], prompt_lookup_num_tokens=3, **GREEDY)


# ---------------------------------------------------------------------------------------------------------------
# the static cache's recorded steps. A CUDA graph needs a GPU (tests/gpu/test_speculative_gpu.py runs the real
# ones); here the recording keeps the step function and a replay runs it again, as test_cache_generation does: the
# bookkeeping (one graph per step shape, the round's device offsets, reuse across calls) is the real code.


def test_static_speculation_replays_one_graph_per_step_shape(recorded_steps):
    model, draft = tiny_model(seed=0, **CONFIGS["k3"]), tiny_model(seed=1, **CONFIGS["k3"])
    x, mask = left_padded(repetitive(seed=2), repetitive(T=7, seed=3))
    kw = dict(attention_mask=mask, max_new_tokens=8, cache_implementation="static", **GREEDY)
    with torch.no_grad():
        ref = model.generate(x, attention_mask=mask, max_new_tokens=8, **GREEDY)
        got = [model.generate(x, prompt_lookup_num_tokens=4, **kw) for _ in range(2)]
        lookup_graphs = len(recorded_steps)
        assisted = model.generate(x, assistant_model=draft, **dict(DRAFT, num_assistant_tokens=4), **kw)
    assert all(torch.equal(g, ref) for g in got) and torch.equal(assisted, ref)
    # prompt lookup: a verification of 4 + 1 tokens and a plain step (no candidates); the second call replays them
    assert lookup_graphs == 2
    (graphs,) = model._static_pool().step_graphs.values()
    assert sorted(graphs) == [(1, False), (5, True)]
    # assisted: the target's verification is the same graph; the draft's steps (1 or 2 tokens) are its own
    assert sorted(next(iter(draft._static_pool().step_graphs.values()))) == [(1, True), (2, True)]
    assert len(recorded_steps) == 4
    model.release_static_caches()
    draft.release_static_caches()


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
    """The bundled K3 model with an image: prompt lookup on the static cache, a draft of the same kind (its cache
    holds the image too), and its text model as a draft (reads the placeholder as a token)."""
    model, inputs = vlm
    draft = copy.deepcopy(model)  # the same kind of model with another head: it disagrees now and then
    with torch.no_grad():
        draft.language_model.lm_head.weight.add_(torch.randn_like(draft.language_model.lm_head.weight),
                                                 alpha=0.5 * float(draft.language_model.lm_head.weight.std()))
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=511)
        ref = model.generate(**inputs, **kw)
        lookup = model.generate(**inputs, prompt_lookup_num_tokens=3, cache_implementation="static", **kw)
        kw.update(DRAFT)
        assisted = model.generate(**inputs, assistant_model=draft, **kw)  # both caches hold the image
        assert rollbacks
        text_draft = model.generate(**inputs, assistant_model=draft.language_model, **kw)
    model.release_static_caches()
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
# sampling: speculative sampling keeps the distribution plain sampling draws from


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


N_DRAWS = 150  # rows of one batch, each an independent draw of the first two tokens
SIGNIFICANCE = 1e-3  # each test below rejects a correct sampler with probability 1e-3 (fixed seed: deterministic)


def test_speculative_sampling_keeps_the_sampling_distribution(rollbacks):
    """The joint distribution of the first two sampled tokens (one batch of N_DRAWS rows, so every row runs its own
    acceptance) against the exact one: with a draft model (the min(1, p/q) rule and the residual max(0, p - q)) and
    with prompt lookup (a deterministic proposal kept when the target's sample equals it)."""
    model, draft = micro(2, scale=1.0), micro(3, scale=1.0)
    eos = model.config.eos_token_id
    kw = dict(do_sample=True, max_new_tokens=2, min_new_tokens=2, pad_token_id=0, top_k=0)
    torch.manual_seed(0)
    for prompt, extra in ((torch.tensor([[3]]), dict(assistant_model=draft, **DRAFT)),
                          (torch.tensor([[3, 4, 1, 3]]), dict(prompt_lookup_num_tokens=2))):
        p = two_step_distribution(model, prompt, eos)
        with torch.no_grad():
            out = model.generate(prompt.repeat(N_DRAWS, 1), **kw, **extra)[:, prompt.shape[1]:]
        counts = torch.zeros_like(p).index_put_((out[:, 0], out[:, 1]), torch.ones(N_DRAWS, dtype=p.dtype),
                                                accumulate=True)
        assert chi_square_p(counts, p) > SIGNIFICANCE, extra
        if "assistant_model" in extra:
            q = two_step_distribution(draft, prompt, eos)
            assert 0.5 * float((p - q).abs().sum()) > 0.3  # the draft proposes from quite another distribution
            assert chi_square_p(counts, q) < 1e-9  # the test tells the two apart
        assert len(rollbacks) > 0  # rejected candidates: some second tokens came after a rollback
        rollbacks.clear()


# ---------------------------------------------------------------------------------------------------------------
# the cache: speculation rounds, crop, checkpoint, copy, batch_repeat_interleave


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=12, **CONFIGS["k3"])


def states(cache, row=None):
    out = [t for i, c in enumerate(cache.conv_states) if c is not None
           for t in c + (cache.recurrent_states[i],)]
    return out if row is None else [t[row:row + 1] for t in out]


def prefilled(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=True).past_key_values


@pytest.mark.parametrize("static", [False, True])
def test_keep_rows_then_compact(model, static):
    """Row 0 keeps 1 of a round's 4 positions, row 1 all 4: each row's KDA states equal a fresh prefill of its kept
    tokens and the dropped positions are holes; after a second round both rows have holes, and compact() removes the
    one they share without changing the next logits. Static: the mask is the `valid` buffer, every forward addressed
    by device positions (what generate() does there), the latents moved in place."""
    from transformers_kimi3.decode_graphs import addressed_step

    x = ids(24, seed=13).view(2, 12)
    cache = Kimi3Cache(model.config, max_length=14 if static else None)

    def step(c, tokens):
        return addressed_step(model, c, tokens) if static else model(input_ids=tokens, past_key_values=c).logits

    def mask(c):
        return c.valid[:, :c.seen_tokens].long() if static else c.attention_mask

    with torch.no_grad():
        model(input_ids=x[:, :6], past_key_values=cache)
        if static:
            cache.track_valid(2, "cpu")
        cache.begin_round(5)
        step(cache, x[:, 6:9])  # a verification of 3 tokens
        step(cache, x[:, 9:10])  # and a draft-style step
        cache.keep_rows([1, 4])
        assert cache.seen_tokens == 10 and mask(cache)[0, 7:].sum() == 0
        for row, keep in ((0, 7), (1, 10)):
            ref = prefilled(model, x[row:row + 1, :keep])
            assert all(rel_err(a, b) < TOL for a, b in zip(states(cache, row), states(ref)))
        # the next round: row 0 continues with its tokens 7..8, row 1 keeps 1 of its 2 positions
        cache.begin_round(2)
        step(cache, torch.stack([x[0, 7:9], x[1, 10:12]]))
        cache.keep_rows(torch.tensor([2, 1]))
        assert cache.seen_tokens == 12 and mask(cache).sum(1).tolist() == [9, 11]
        nxt = torch.tensor([[50], [51]])
        before = step(copy.deepcopy(cache), nxt)
        addresses = [t.data_ptr() for t in cache.latents if t is not None]
        assert cache.compact() == 1 and cache.seen_tokens == 11 and mask(cache)[0, :2].sum() == 0
        assert not static or [t.data_ptr() for t in cache.latents if t is not None] == addresses
        after = step(cache, nxt)
        want = torch.cat([model(input_ids=torch.cat([x[b:b + 1, :k], nxt[b:b + 1]], 1)).logits[:, -1:]
                          for b, k in ((0, 9), (1, 11))])
    assert rel_err(after, before) < TOL and rel_err(after, want) < TOL
    with pytest.raises(ValueError, match="call begin_round"):
        cache.keep_rows([1, 1])


class DeviceOps(TorchDispatchMode):
    """Counts the tensor operations that do work, views left out: on a GPU each is a launch and its host time."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def round_ops(model, static):
    """Operations of a speculation round of 5 positions on a batch of 3 rows keeping 2, 5 and 1 of them (the row that
    keeps all lies between two that drop some), after a first round: (begin_round + keep_rows, record_round)."""
    from transformers_kimi3.decode_graphs import addressed_step

    x = ids(33, seed=21).view(3, 11)
    cache = Kimi3Cache(model.config, max_length=16 if static else None)
    with torch.no_grad():
        model(input_ids=x[:, :6], past_key_values=cache)
        if static:
            cache.track_valid(3, "cpu")
        rounds, record = DeviceOps(), DeviceOps()
        record_round = cache.record_round

        def counted_record(*args, **kwargs):
            with record:
                return record_round(*args, **kwargs)

        cache.record_round = counted_record
        for counts in ([5, 5, 5], [2, 5, 1]):  # the first round allocates the buffers
            counting = counts != [5, 5, 5]
            with rounds if counting else contextlib.nullcontext():
                cache.begin_round(5)
            record.n = 0
            if static:
                addressed_step(model, cache, x[:, 6:11])
            else:
                model(input_ids=x[:, 6:11], past_key_values=cache)
            with rounds if counting else contextlib.nullcontext():
                cache.keep_rows(counts)
    return rounds.n, record.n


@pytest.mark.parametrize("static", [False, True])
def test_a_round_costs_the_same_operations_for_any_number_of_kda_layers(static):
    """begin_round + keep_rows run a fixed number of device operations whatever the number of KDA layers (base
    states copied with one multi-tensor copy, every layer's recurrence rerun as one, the conv windows one gather), and
    record_round two per layer and forward (the inputs concatenated, then written): a stack of 2 KDA layers against
    one of 6 (one MLA layer each)."""
    small = tiny_model(seed=3, num_hidden_layers=3,
                       linear_attn_config=dict(LAC, kda_layers=[1, 2], full_attn_layers=[3]))
    large = tiny_model(seed=3, num_hidden_layers=7,
                       linear_attn_config=dict(LAC, kda_layers=[1, 2, 3, 4, 5, 6], full_attn_layers=[7]))
    (round_small, record_small), (round_large, record_large) = (round_ops(m, static) for m in (small, large))
    assert round_large - round_small < 4, (round_small, round_large)  # fewer than one per added KDA layer
    assert record_large - record_small <= 2 * 4, (record_small, record_large)


def test_a_row_that_keeps_every_position_between_rows_that_drop_keeps_its_states(model):
    """keep_rows reruns the rows from the first to the last that drop positions; a row between them that keeps every
    position keeps its live states bit for bit, the others equal a fresh prefill of their kept tokens."""
    x = ids(33, seed=22).view(3, 11)
    cache = Kimi3Cache(model.config)
    with torch.no_grad():
        model(input_ids=x[:, :6], past_key_values=cache)
        cache.begin_round(5)
        model(input_ids=x[:, 6:11], past_key_values=cache)
        live = [t.clone() for t in states(cache, 1)]
        cache.keep_rows([2, 5, 1])
        assert all(torch.equal(a, b) for a, b in zip(states(cache, 1), live))
        for row, keep in ((0, 8), (2, 7)):
            ref = prefilled(model, x[row:row + 1, :keep])
            assert all(rel_err(a, b) < TOL for a, b in zip(states(cache, row), states(ref)))


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
        got_ab = model.generate(torch.cat([prefix.repeat(2, 1), torch.cat([qa, qb])], 1), past_key_values=both,
                                prompt_lookup_num_tokens=2, **kw)
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


# ---------------------------------------------------------------------------------------------------------------
# the benchmark's harness, on the CPU at toy sizes (the GPU run: bench/speculative.py, docs/performance.md)


def test_the_speculative_benchmark_runs_on_the_cpu(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_speculative", os.path.join(ROOT, "bench", "speculative.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "speculative.json"
    res = bench.main(["--config", "tiny", "--device", "cpu", "--prompt", "24", "--new-tokens", "6", "--ks", "2",
                      "--reps", "1", "--lookup-tokens", "3", "--assistant-tokens", "2", "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["meta"]["device"] == "cpu" and run["meta"]["date"] and "commit" in run["meta"]
    rows = run["rows"]
    assert [r["stage"] for r in rows] == ["rollback", "verify"] + ["generate"] * 6
    assert {r["impl"] for r in rows[2:]} == {"static_greedy", "prompt_lookup", "assisted"}
    assert 0 < rows[1]["keep_half_host_ms"] <= rows[1]["keep_half_ms"]  # the host part is inside the total
    assert all(r["tokens_equal_static_greedy"] for r in rows[2:]) and not res.mismatches
