"""What fine-tuning code expects of a Transformers model: `resize_token_embeddings` for added special tokens,
generate() continuing from `inputs_embeds` on a returned cache, and a parameter set in which every trainable tensor
gets a gradient (DistributedDataParallel without `find_unused_parameters`)."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimi3_testing import rel_err, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3Config, Kimi3ForCausalLM, Kimi3ForConditionalGeneration

VOCAB = 96  # tiny_k3_text_config's
# Layer 0's attention-side AttnRes mix never runs (its bank is empty): the two tensors that get no gradient
NO_GRADIENT = {"model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"}


# 4 layers: KDA, MLA, KDA, MLA; dense FFN then MoE; AttnRes blocks of 2 layers (bank writes at layers 0 and 2)
SMALL = dict(num_hidden_layers=4, attn_res_block_size=2,
             linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     use_full_rank_gate=True, kda_layers=[1, 3], full_attn_layers=[2, 4]))


def small_model():
    return tiny_model(**SMALL)


def ids(batch, length, seed=0, low=3, high=VOCAB):
    return torch.randint(low, high, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# resize_token_embeddings


@pytest.mark.parametrize("new_size", [VOCAB + 12, 80])
def test_resize_token_embeddings_sets_the_vocabulary(new_size, tmp_path):
    model = small_model()
    model.resize_token_embeddings(new_size, mean_resizing=False)
    assert model.config.vocab_size == new_size == model.model.embed_tokens.num_embeddings
    x = torch.cat([ids(2, 6, high=min(new_size, VOCAB)), torch.full((2, 1), new_size - 1)], 1)  # the last id
    with torch.no_grad():
        out = model(input_ids=x, labels=x)
    assert out.logits.shape == (2, 7, new_size) and torch.isfinite(out.loss)
    with pytest.raises(ValueError, match=rf"input_ids hold \[{new_size}\] outside the vocabulary 0\.\.{new_size - 1}"):
        model(input_ids=torch.tensor([[5, new_size]]))
    model.save_pretrained(tmp_path)
    back = Kimi3ForCausalLM.from_pretrained(tmp_path)
    assert back.config.vocab_size == new_size == back.model.embed_tokens.num_embeddings
    assert back.lm_head.weight.shape == (new_size, model.config.hidden_size)
    with torch.no_grad():  # a reloaded model differs from the saved one by fp32 rounding (8e-8), resized or not
        assert rel_err(back(input_ids=x).logits, out.logits) < 1e-6


def test_resize_token_embeddings_of_the_multimodal_model(tmp_path):
    text = tiny_k3_text_config(**SMALL)
    vision = dict(vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=1,
                  qkv_hidden_size=32, mm_hidden_size=32, text_hidden_size=text.hidden_size, init_pos_emb_height=4,
                  init_pos_emb_width=4, init_pos_emb_time=2)
    torch.manual_seed(0)
    model = Kimi3ForConditionalGeneration(Kimi3Config(text_config=text, vision_config=vision,
                                                      media_placeholder_token_id=VOCAB - 1)).eval()
    new_size = VOCAB + 8
    model.resize_token_embeddings(new_size, mean_resizing=False)
    assert model.config.text_config.vocab_size == new_size == model.language_model.config.vocab_size
    x = torch.tensor([[5, 7, new_size - 1, VOCAB]])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    assert logits.shape == (1, 4, new_size)
    with pytest.raises(ValueError, match=rf"input_ids hold \[{new_size}\] outside the vocabulary"):
        model(input_ids=torch.tensor([[5, new_size]]))
    model.save_pretrained(tmp_path)
    back = Kimi3ForConditionalGeneration.from_pretrained(tmp_path)
    assert back.config.text_config.vocab_size == new_size
    with torch.no_grad():
        assert rel_err(back(input_ids=x).logits, logits) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# generate() from inputs_embeds, continued on the returned cache


def _greedy(model, **kwargs):
    return model.generate(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          **kwargs)


def test_generate_from_inputs_embeds_continues_on_the_returned_cache():
    model = small_model()
    embed = model.get_input_embeddings()
    prompt, user = ids(2, 6, seed=1), ids(2, 3, seed=2)
    with torch.no_grad():
        first = _greedy(model, input_ids=prompt)
        conversation = torch.cat([first.sequences, user], 1)
        ref = _greedy(model, input_ids=conversation, past_key_values=first.past_key_values)
        ref = ref.sequences[:, conversation.shape[1]:]

        out = _greedy(model, inputs_embeds=embed(prompt))
        assert torch.equal(out.sequences, first.sequences[:, prompt.shape[1]:])  # only the new tokens
        conversation = torch.cat([prompt, out.sequences, user], 1)
        history = out.past_key_values.source_tokens  # the last generated token is not in the cache yet
        assert history == conversation.shape[1] - user.shape[1] - 1
        whole = dict(inputs_embeds=embed(conversation))  # as Transformers continues from inputs_embeds
        # only what the cache has not consumed, alone or with a mask over the whole conversation
        new = dict(inputs_embeds=embed(conversation[:, history:]))
        new_masked = dict(new, attention_mask=torch.ones_like(conversation))
        for kwargs in (whole, new, new_masked):
            cache = copy.deepcopy(out.past_key_values)
            got = _greedy(model, past_key_values=cache, **kwargs)
            assert torch.equal(got.sequences, ref)


# ---------------------------------------------------------------------------------------------------------------
# every trainable tensor gets a gradient; DistributedDataParallel without find_unused_parameters


def test_every_trainable_parameter_gets_a_gradient():
    model = tiny_model().train()  # 7 layers, AttnRes blocks of 3
    x = ids(2, 12)
    model(input_ids=x, labels=x).loss.backward()
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == NO_GRADIENT
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


def test_tensors_without_gradient_load_and_save_byte_identical(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "a")
    back = Kimi3ForCausalLM.from_pretrained(tmp_path / "a")
    params = dict(back.named_parameters())
    for name in NO_GRADIENT:  # loaded with their values, still frozen
        assert torch.equal(params[name], dict(model.named_parameters())[name]) and not params[name].requires_grad
    back.save_pretrained(tmp_path / "b")
    a, b = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("a", "b"))
    assert a == b


STEPS, ROWS, WORLD = 3, 4, 2
HALVES = [slice(rank, None, WORLD) for rank in range(WORLD)]  # each rank's rows of every batch


def _batch(step):
    return ids(ROWS, 10, seed=100 + step)


def _train(model, parts):
    """Per step: the trainable parameters' gradients over the batch rows `parts` (one backward each, losses
    averaged over the parts), after which SGD moves them."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    inner = getattr(model, "module", model)
    grads = []
    for step in range(STEPS):
        for rows in parts:
            x = _batch(step)[rows]
            (model(input_ids=x, labels=x).loss / len(parts)).backward()
        grads.append({n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return grads


def _ddp_worker(rank, folder):
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        model = torch.nn.parallel.DistributedDataParallel(small_model().train())  # find_unused_parameters=False
        torch.save(_train(model, [HALVES[rank]]), os.path.join(folder, f"grads{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _max_rel(a, b):
    return max(float((a[n] - b[n]).abs().max()) / max(float(b[n].abs().max()), 1e-12) for n in b)


def test_ddp_without_find_unused_parameters_equals_one_process(tmp_path):
    """Two CPU processes (gloo), each on half of every batch, for 3 SGD steps. With an unused trainable tensor DDP's
    second step fails ("Expected to have finished reduction in the prior iteration"). DDP averages the two halves'
    gradients: one process accumulating the same halves gives the same gradients at every step. The whole batch in
    one backward differs from the halves by fp32 rounding (1e-6 relative at the first step); after an update that
    rounding can flip a token's expert choice, so later steps are compared with the halves only."""
    mp.start_processes(_ddp_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="fork")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the thread count changes how CPU kernels round
    try:
        model = small_model().train()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        ref = _train(model, HALVES)
        whole = _train(small_model().train(), [slice(None)])
    finally:
        torch.set_num_threads(threads)
    assert set(ref[0]) == trainable and trainable.isdisjoint(NO_GRADIENT)
    assert _max_rel(ref[0], whole[0]) < 5e-6
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"grads{rank}.pt")
        for step in range(STEPS):
            assert got[step].keys() == ref[step].keys()
            assert _max_rel(got[step], ref[step]) <= 1e-6, (rank, step)
