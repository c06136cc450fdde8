"""Packed sequences: documents sharing a row (position_ids restarting at 0, as DataCollatorWithFlattening writes
them) give the same logits, loss and gradients as each document alone: nothing leaks through KDA state, convs,
MLA attention or AttnRes."""

import torch

from kimi3_testing import rel_err, tiny_model


def test_packed_row_equals_separate_documents():
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 96, (n,), generator=gen) for n in (9, 1, 30, 5)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = ids.clone()
    out = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    start = 0
    for d in docs:
        alone = model(input_ids=d[None], use_cache=False).logits
        assert rel_err(out.logits[0, start:start + len(d)], alone[0]) < 1e-5
        start += len(d)
    # loss and gradients: the packed row against the sum over documents (labels shift inside each document)
    model.zero_grad()
    lp = torch.log_softmax(out.logits.float(), -1)
    tgt_mask = torch.ones(ids.shape[1], dtype=torch.bool)
    tgt_mask[torch.cumsum(torch.tensor([len(d) for d in docs]), 0)[:-1] - 1] = False  # no target across documents
    nll = -lp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0][tgt_mask[:-1]].sum()
    nll.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for d in docs:
        lp = torch.log_softmax(model(input_ids=d[None], use_cache=False).logits.float(), -1)
        (-lp[0, :-1].gather(-1, d[1:, None])[:, 0].sum()).backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert rel_err(packed_grads[n], p.grad) < 1e-4, (n, rel_err(packed_grads[n], p.grad))


def test_flash_attention_kwargs_give_the_same_split():
    model = tiny_model()
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(12), torch.arange(8)])[None]
    a = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    b = model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 12, 20]), use_cache=False).logits
    assert torch.equal(a, b)
    second_alone = model(input_ids=ids[:, 12:], use_cache=False).logits
    assert rel_err(a[:, 12:], second_alone) < 1e-5
