"""The Transformers output contract: output_attentions (MLA probability maps, none for KDA layers, as Transformers'
Kimi Linear), return_dict=False (tuples, loss first) on all three model classes, and 4-D attention masks (MLA-only
models take them; a model with KDA layers refuses them by name)."""

import pytest
import torch

from kimi3_testing import tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3Config, Kimi3ForConditionalGeneration, Kimi3Model

ALL_MLA = dict(linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                       use_full_rank_gate=True, kda_layers=[], full_attn_layers=list(range(1, 8))))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def ids(B, T, seed=0):
    return torch.randint(3, 96, (B, T), generator=torch.Generator().manual_seed(seed))


def left_padded(B=2, T=7, pad=3):
    x, mask = ids(B, T), torch.ones(B, T, dtype=torch.long)
    mask[1, :pad] = 0
    return x.masked_fill(mask == 0, 0), mask


def mla_layers(model):
    return [layer for layer in model.model.layers if not layer.is_kda]


def test_output_attentions_are_the_mla_layers_probabilities(model):
    """One [B, heads, T, T] map per MLA layer, in layer order (KDA layers have none); valid query rows sum to 1 and
    give padded keys and future positions exactly 0; the layer's output rebuilt from them is its normal output."""
    x, mask = left_padded()
    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0], o)))
             for i, layer in enumerate(mla_layers(model))]
    try:
        with torch.no_grad():
            plain = model(input_ids=x, attention_mask=mask, use_cache=False)
            normal = dict(seen)
            out = model(input_ids=x, attention_mask=mask, use_cache=False, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    assert plain.attentions is None
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-5, rtol=0)
    layers = mla_layers(model)
    assert len(out.attentions) == len(layers) == model.config.layer_types.count("full_attention")
    B, T = x.shape
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for i, (layer, probs) in enumerate(zip(layers, out.attentions)):
        attn = layer.self_attn
        assert probs.shape == (B, attn.num_heads, T, T)
        for b in range(B):
            valid = mask[b].bool()
            rows = probs[b][:, valid]  # the valid queries' rows
            torch.testing.assert_close(rows.sum(-1), torch.ones_like(rows[..., 0]), atol=1e-6, rtol=0)
            assert (rows[..., ~valid] == 0).all() and (probs[b][:, future] == 0).all()
        # the MLA output from these probabilities: probs @ v, output gate, o_proj
        h, expected = normal[i]
        c_kv, _ = attn.kv_a_proj_with_mqa(h).split([attn.kv_lora_rank, attn.rope], dim=-1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(c_kv)).view(B, T, attn.num_heads, attn.nope + attn.v_dim)
        v = kv[..., attn.nope:].transpose(1, 2)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, -1)
        o = attn.o_proj(o * torch.sigmoid(attn.g_proj(h)))
        torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-5)


def test_generate_returns_the_attentions(model):
    """generate(output_attentions=True, return_dict_in_generate=True): per step, one map per MLA layer over every
    position so far; padded prompt keys stay at 0 in the decode steps; the tokens are the plain generate's."""
    x, mask = left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    with torch.no_grad():
        plain = model.generate(x, **kw)
        out = model.generate(x, output_attentions=True, **kw)
    assert torch.equal(out.sequences, plain.sequences)
    B, T = x.shape
    n_mla = len(mla_layers(model))
    assert len(out.attentions) == 3 and all(len(step) == n_mla for step in out.attentions)
    for s, step in enumerate(out.attentions):
        q = T if s == 0 else 1
        for probs in step:
            assert probs.shape == (B, model.config.num_attention_heads, q, T + s)
            assert (probs[1, :, -1, :3] == 0).all()
            torch.testing.assert_close(probs[:, :, -1].sum(-1), torch.ones(B, probs.shape[1]), atol=1e-6, rtol=0)


def tiny_multimodal():
    torch.manual_seed(0)
    vision = dict(vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=1,
                  qkv_hidden_size=32, mm_hidden_size=32, text_hidden_size=64, init_pos_emb_height=4,
                  init_pos_emb_width=4)
    config = Kimi3Config(text_config=tiny_k3_text_config().to_dict(), vision_config=vision,
                         media_placeholder_token_id=95)
    return Kimi3ForConditionalGeneration(config).eval()


def test_return_dict_false_gives_the_tuple_on_every_model_class(model):
    """return_dict=False (argument or config.return_dict) returns ModelOutput.to_tuple(): the set fields in order,
    loss first when labels are given."""
    x = ids(2, 5)
    base = model.model
    for m, kw in ((model, dict(labels=x)), (tiny_multimodal(), dict(labels=x)), (base, {})):
        with torch.no_grad():
            ref = m(input_ids=x, output_attentions=True, output_hidden_states=True, **kw)
            tup = m(input_ids=x, output_attentions=True, output_hidden_states=True, return_dict=False, **kw)
        assert type(tup) is tuple and len(tup) == len(ref.to_tuple()), type(m).__name__
        if kw:
            assert torch.equal(tup[0], ref.loss) and torch.equal(tup[1], ref.logits)
        else:
            assert isinstance(m, Kimi3Model) and torch.equal(tup[0], ref.last_hidden_state)
        m.config.return_dict = False
        try:
            with torch.no_grad():
                assert type(m(input_ids=x, **kw)) is tuple
        finally:
            m.config.return_dict = True


def test_generate_ignores_config_return_dict(model):
    """generate() (Transformers' loop and the static greedy loop) asks for ModelOutputs itself."""
    x = ids(1, 4)
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = [model.generate(x, **kw), model.generate(x, cache_implementation="static", **kw)]
        model.config.return_dict = False
        try:
            got = [model.generate(x, **kw), model.generate(x, cache_implementation="static", **kw)]
        finally:
            model.config.return_dict = True
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_4d_mask_is_refused_by_a_model_with_kda_layers(model):
    x = ids(1, 6)
    mask4 = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"attention_mask is 4-D.*KDA.*2-D padding mask"):
        model(input_ids=x, attention_mask=mask4)


def test_4d_mask_in_a_model_without_kda_layers():
    """Transformers' shared-prefix check (test_custom_4d_attention_mask): three continuations of one prefix in one
    row, kept apart by a 4-D float mask, give the logits of the three separate rows; a boolean mask is the same; a
    4-D mask continues a cache; a wrong shape or an int mask is refused."""
    model = tiny_model(**ALL_MLA)
    rows = torch.tensor([[10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 12, 15]])
    shared = torch.tensor([[10, 11, 12, 13, 14, 15]])
    allowed = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                            [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]]).bool()[None, None]
    additive = (~allowed).float() * torch.finfo(torch.float32).min
    with torch.no_grad():
        separate = model(input_ids=rows, use_cache=False).logits[:, -1]
        packed = model(input_ids=shared, attention_mask=additive, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]]),
                       use_cache=False).logits
        boolean = model(input_ids=shared, attention_mask=allowed, use_cache=False).logits
        torch.testing.assert_close(packed[0, -3:], separate, atol=1e-5, rtol=1e-5)
        assert torch.equal(boolean, packed)
        # a 4-D mask over cache + this call: the second half of a causal pass
        full = model(input_ids=shared, use_cache=False).logits
        cache = model(input_ids=shared[:, :3], use_cache=True).past_key_values
        causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None, 3:]
        tail = model(input_ids=shared[:, 3:], attention_mask=causal, past_key_values=cache).logits
        torch.testing.assert_close(tail, full[:, 3:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"attention_mask is 4-D with shape \[1, 1, 6, 5\].*\[1, 1, 6, 6\]"):
        model(input_ids=shared, attention_mask=additive[..., :5])
    with pytest.raises(ValueError, match="attention_mask is a 4-D torch.int64 mask"):
        model(input_ids=shared, attention_mask=allowed.long())


def test_fp32_logits_resolve_only_bf16_rounding_ties():
    """config.fp32_logits: a bf16 model's logits come out in fp32, the product of the same bf16 hidden states and head
    weight; where their argmax differs from the bf16 logits' argmax, the two candidates are a tie in bf16 (within one
    bf16 rounding step of each other), so the option changes near-ties only. The setting is saved only when on and a
    non-bool is refused by name."""
    import torch.nn.functional as F

    from kimi3_testing import ROOT
    from transformers_kimi3 import Kimi3ForCausalLM

    folder = f"{ROOT}/assets/kimi-k3-mini"
    plain = Kimi3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    wide = Kimi3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, fp32_logits=True).eval()
    x = torch.randint(3, 7900, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = wide.model(input_ids=x).last_hidden_state
        a, b = plain(input_ids=x).logits, wide(input_ids=x).logits
    assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.equal(b, F.linear(h.float(), wide.lm_head.weight.float()))
    ulp = 2.0 ** (torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)  # bf16's rounding step at each logit
    assert ((a.float() - b).abs() <= ulp).float().mean() > 0.99  # the bf16 logits are these, rounded (CPU bf16 GEMMs
    # may round partial sums too, so not every one)
    pa, pb = a.argmax(-1), b.argmax(-1)
    moved = (pa != pb).nonzero().tolist()
    assert len(moved) < 0.1 * pa.numel(), len(moved)
    for i, t in moved:  # within two rounding steps in bf16: a tie the rounding made
        assert a[i, t, pa[i, t]] - a[i, t, pb[i, t]] <= 2 * ulp[i, t, pa[i, t]], (i, t)
    assert "fp32_logits" not in plain.config.to_dict() and wide.config.to_dict()["fp32_logits"] is True
    with pytest.raises(ValueError, match="fp32_logits"):
        Kimi3ForCausalLM.from_pretrained(folder, fp32_logits=1)
    wide.resize_token_embeddings(8200, mean_resizing=False)  # Transformers builds a plain nn.Linear head
    with torch.no_grad():
        assert wide(input_ids=x[:, :4]).logits.dtype == torch.float32
