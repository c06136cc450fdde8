"""Quantile Balancing (SPEC 6) as a Trainer callback: the update rule, convergence on a skewed routing problem through
`transformers.Trainer`, the bias staying out of autograd, statistics in the Trainer's logs, and no double counting
under gradient checkpointing."""

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from kimi3_testing import tiny_k3_text_config, tiny_model
from transformers_kimi3.moe import Kimi3TopkRouter
from transformers_kimi3.training import (
    QuantileBalancingCallback,
    expert_load,
    expert_load_stats,
    find_routers,
    load_imbalance,
    margin_histogram,
    quantile_balancing_shift,
    router_margins,
    shift_from_histogram,
)

N_EXPERTS, TOP_K, D = 16, 2, 32
TOKENS_PER_STEP = 64 * 256  # q = 2048 tokens per expert: sampling noise of a fresh batch ~2%, well under the 10%


@pytest.mark.parametrize("margin", ["boundary", "spec"])
def test_shift_leaves_exactly_q_positive_margins(margin):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1000, N_EXPERTS, generator=g) ** 3  # skewed
    bias = torch.randn(N_EXPERTS, generator=g) * 0.1
    margins = router_margins(scores, bias, TOP_K, margin)
    # margins > 0 exactly on each token's top-k
    assert torch.equal((margins > 0).sum(-1), torch.full((1000,), TOP_K))
    shift = quantile_balancing_shift(margins, TOP_K)
    q = round(1000 * TOP_K / N_EXPERTS)
    # c_j is the (q+1)-th largest margin: at most q margins above it, at least q+1 at or above it (with SPEC's
    # cutoff each token's (k+1)-th expert has margin exactly 0, so ties at 0 are common; without ties exactly q
    # are left positive)
    assert bool((((margins - shift) > 0).sum(0) <= q).all())
    assert bool((((margins - shift) >= 0).sum(0) >= q + 1).all())
    untied = torch.tensor([int((margins[:, j] == margins[:, j].kthvalue(1000 - q).values).sum()) == 1
                           for j in range(N_EXPERTS)])
    assert torch.equal(((margins - shift) > 0).sum(0)[untied], torch.full((int(untied.sum()),), q))
    # the histogram form agrees within one bin width
    bins = 4096
    counts = margin_histogram(margins, bias, bins)
    assert int(counts.sum()) == 1000 * N_EXPERTS
    width = float(bias.max() - bias.min() + 2) / bins
    approx = shift_from_histogram(counts, bias, 1000, TOP_K)
    assert float((approx - shift).abs().max()) <= width


class SkewedRouting(nn.Module):
    """One K3 router whose weight favours the high-numbered experts on every input: a skewed routing problem."""

    def __init__(self):
        super().__init__()
        cfg = tiny_k3_text_config(hidden_size=D, num_experts=N_EXPERTS, num_experts_per_token=TOP_K)
        self.router = Kimi3TopkRouter(cfg)
        g = torch.Generator().manual_seed(0)
        u = torch.randn(D, generator=g)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(N_EXPERTS, D, generator=g) * 0.3
                                     + torch.linspace(-1.5, 1.5, N_EXPERTS)[:, None] * u / u.norm())
            self.router.e_score_correction_bias.zero_()
        self.register_buffer("offset", u / u.norm() * 2.0)

    def forward(self, x, labels=None):
        _, weights, _ = self.router((x + self.offset).reshape(-1, D))
        return {"loss": (weights ** 2).mean()}  # a loss through the router's weights: they get gradients


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        return {"x": torch.randn(256, D, generator=torch.Generator().manual_seed(i))}


@pytest.mark.parametrize("num_bins", [None, 1024])
def test_quantile_balancing_converges_through_trainer(tmp_path, num_bins):
    model = SkewedRouting()
    bias = model.router.e_score_correction_bias
    weight_before = model.router.weight.detach().clone()
    qb = QuantileBalancingCallback(num_bins=num_bins, log_per_layer=True)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=TOKENS_PER_STEP // 256,
                             max_steps=20, learning_rate=1e-3, logging_steps=5, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0, dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[qb])
    trainer.train()
    ratios = [h["max_over_mean"][0] for h in qb.history]
    assert len(ratios) == 20
    assert ratios[0] > 2.0, ratios  # the problem really is skewed
    assert max(ratios[-10:]) < 1.1, ratios  # balanced within 20 steps (in practice from step 2-3), and stays there
    # the bias is a buffer, never a parameter, never in autograd; the router weight did get gradients
    assert not bias.requires_grad and bias.grad is None
    assert all(p is not bias for group in trainer.optimizer.param_groups for p in group["params"])
    assert not torch.equal(model.router.weight.detach(), weight_before)  # the router itself trains as usual
    assert float(bias.abs().max()) > 0.1
    # statistics reached the Trainer's log
    logged = [h for h in trainer.state.log_history if "moe/load_max_over_mean" in h]
    assert len(logged) == 4 and logged[-1]["moe/load_max_over_mean"] < 1.1
    assert "moe/load_max_over_mean/layer_0" in logged[-1] and "moe/bias_abs_max" in logged[-1]


def test_statistics_only_mode_leaves_the_bias_alone():
    model = SkewedRouting()
    qb = QuantileBalancingCallback(update=False).start(model)
    for i in range(3):
        model(RandomTokens()[i]["x"][None])
        qb.step()
    qb.stop()
    assert float(model.router.e_score_correction_bias.abs().max()) == 0.0
    assert len(qb.history) == 3 and qb.history[0]["max_over_mean"][0] > 2.0


def test_full_model_hooks_count_each_token_once_under_checkpointing():
    """Tiny K3 model, gradient checkpointing on: the router hooks see each token once per step (the backward pass
    recomputes the layers and calls the routers again), padding is left out, the bias never gets a gradient."""
    model = tiny_model().train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    routers = find_routers(model)
    assert [layer for layer, _, _ in routers] == [1, 2, 3, 4, 5, 6]
    qb = QuantileBalancingCallback().start(model)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: 5 tokens that must not count
    calls = []
    handle = routers[0][2].register_forward_hook(lambda *a: calls.append(1))
    before = [r.e_score_correction_bias.clone() for _, _, r in routers]
    out = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    out.loss.backward()
    handle.remove()
    assert len(calls) == 2  # forward + the checkpointed recompute
    assert all(st.tokens == 2 * 24 - 5 for st in qb._layers)
    assert all(int(st.load.sum()) == (2 * 24 - 5) * 2 for st in qb._layers)
    for _, _, r in routers:
        assert r.e_score_correction_bias.grad is None and not r.e_score_correction_bias.requires_grad
    # output_router_logits gives the same loads as the hooks saw
    stats = expert_load_stats(model, out.router_logits, attention_mask=mask)
    for st in qb._layers:
        assert stats[st.layer] == pytest.approx(load_imbalance(st.load))
    qb.step()
    qb.stop()
    moved = [not torch.equal(b, r.e_score_correction_bias) for b, (_, _, r) in zip(before, routers)]
    assert all(moved)
    assert len(qb.history) == 1 and set(qb.history[0]["max_over_mean"]) == {1, 2, 3, 4, 5, 6}


def test_expert_load_helpers():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    load = expert_load(idx, 4)
    assert load.tolist() == [3, 2, 1, 0]
    assert load_imbalance(load) == pytest.approx(3 / 1.5)
    with pytest.raises(ValueError):
        QuantileBalancingCallback(num_bins=1)
