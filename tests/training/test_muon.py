"""Per-Head Muon (`transformers_kimi3.muon`): the sorting of every parameter of a tiny K3 (KDA, MLA, dense MLP,
latent MoE with shared experts, AttnRes), each head / expert block orthogonalised on its own, the 0.2*sqrt(max) scale,
decoupled weight decay, the AdamW part equal to torch.optim.AdamW, bit-identical resume from state_dict, bf16
parameters, Trainer with gradient accumulation, and DTensor-sharded parameters on two (thread) ranks."""

import io
import math
import threading

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kimi3_testing import tiny_model
from transformers_kimi3 import PerHeadMuon, build_per_head_muon
from transformers_kimi3.muon import muon_layouts

# 2 layers: KDA with a dense FFN, MLA with the latent MoE; AttnRes blocks of 1
SMALL = dict(num_hidden_layers=2, attn_res_block_size=1,
             linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     use_full_rank_gate=True, kda_layers=[1], full_attn_layers=[2]))


def batch(seed, B=2, T=16):
    ids = torch.randint(3, 96, (B, T), generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, labels=ids)


def train_step(model, opt, seed):
    loss = model(**batch(seed)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def ns5(block):
    """Newton-Schulz written out for one 2-D block: the reference the optimizer's batched blocks must match."""
    x = block.bfloat16()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        A = x @ x.T
        x = 3.4445 * x + (-4.7750 * A + 2.0315 * (A @ A)) @ x
    return (x.T if tall else x).float()


def blocks_of(t, layout):
    """The parameter's blocks as a list of 2-D tensors, sliced by hand."""
    if layout.blocks == "rows":
        return list(t.split(layout.block_size, dim=0))
    if layout.blocks == "cols":
        return list(t.split(layout.block_size, dim=1))
    if layout.blocks == "experts":
        return list(t.unbind(0))
    return [t]


# ----------------------------------------------------------------------------- sorting
A, W, E = "adamw", "muon whole", "muon experts"
KDA = {"A_log": A, "dt_bias": A, "q_proj.weight": "muon rows 16", "k_proj.weight": "muon rows 16",
       "v_proj.weight": "muon rows 16", "q_conv1d.weight": A, "k_conv1d.weight": A, "v_conv1d.weight": A,
       "f_a_proj.weight": W, "f_b_proj.weight": W, "b_proj.weight": W, "g_proj.weight": "muon rows 16",
       "o_norm.weight": A, "o_proj.weight": "muon cols 16"}
# q head = nope 16 + rope 8; kv_b head = k_nope 16 + v 16; g and o per v_head_dim 16
MLA = {"q_a_proj.weight": W, "q_a_layernorm.weight": A, "q_b_proj.weight": "muon rows 24",
       "kv_a_proj_with_mqa.weight": W, "kv_a_layernorm.weight": A, "kv_b_proj.weight": "muon rows 32",
       "g_proj.weight": "muon rows 16", "o_proj.weight": "muon cols 16"}
DENSE = {"mlp.gate_proj.weight": W, "mlp.up_proj.weight": W, "mlp.down_proj.weight": W}
MOE = {"gate.weight": W, "routed_expert_down_proj.weight": W, "routed_expert_up_proj.weight": W,
       "routed_expert_norm.weight": A, "experts.w1": E, "experts.w3": E, "experts.w2": E,
       "shared_experts.gate_proj.weight": W, "shared_experts.up_proj.weight": W, "shared_experts.down_proj.weight": W}
NORMS_AND_ATTN_RES = {"input_layernorm.weight": A, "post_attention_layernorm.weight": A,
                      "self_attention_res_proj.weight": A, "self_attention_res_norm.weight": A,
                      "mlp_res_proj.weight": A, "mlp_res_norm.weight": A}
TOP = {"model.embed_tokens.weight": A, "model.norm.weight": A, "model.output_attn_res_proj.weight": A,
       "model.output_attn_res_norm.weight": A, "lm_head.weight": A}
FROZEN = {"model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"}


def expected_sorting():
    """The tiny K3 of kimi3_testing: MLA at layers 3 and 6 (0-based), KDA elsewhere; layer 0 dense, the rest MoE;
    layer 0's attention-side AttnRes pair frozen."""
    out = dict(TOP)
    for i in range(7):
        attn = MLA if i in (3, 6) else KDA
        ffn = DENSE if i == 0 else {f"block_sparse_moe.{k}": v for k, v in MOE.items()}
        for part in ({f"self_attn.{k}": v for k, v in attn.items()}, ffn, NORMS_AND_ATTN_RES):
            out.update({f"model.layers.{i}.{k}": v for k, v in part.items()})
    return {k: v for k, v in out.items() if k not in FROZEN}


def describe(layout):
    return " ".join(str(x) for x in layout if x is not None)


def test_every_parameter_of_a_tiny_k3_is_sorted_as_documented():
    model = tiny_model()
    got = {n: describe(lay) for n, lay in muon_layouts(model).items()}
    assert got == expected_sorting()
    assert set(dict(model.named_parameters())) - set(got) == FROZEN

    opt = build_per_head_muon(model, lr=1e-3, weight_decay=0.1)
    in_groups = {}
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            in_groups[name] = describe((g["algorithm"], g["blocks"], g["block_size"]))
            assert g["weight_decay"] == (0.0 if g["algorithm"] == "adamw" and p.dim() < 2 else 0.1), name
    assert in_groups == got


def test_variant_layouts_low_rank_kda_gate_and_mla_without_q_lora():
    lac = dict(SMALL["linear_attn_config"], use_full_rank_gate=False)
    got = {n: describe(lay) for n, lay in muon_layouts(tiny_model(**dict(SMALL, linear_attn_config=lac),
                                                                  q_lora_rank=None)).items()}
    assert got["model.layers.0.self_attn.g_a_proj.weight"] == W
    assert got["model.layers.0.self_attn.g_b_proj.weight"] == "muon rows 16"
    assert got["model.layers.1.self_attn.q_proj.weight"] == "muon rows 24"


# ----------------------------------------------------------------------------- the update
def test_each_head_and_expert_block_is_orthogonalised_on_its_own():
    """Two steps (lr 1, no decay): every block of the second update is 0.2*sqrt(max(r, c)) * NS5 of that block's
    Nesterov momentum, computed here block by block; for head-split weights that differs from NS5 of the matrix."""
    model = tiny_model(**SMALL).train()
    opt = build_per_head_muon(model, lr=1.0, weight_decay=0.0, momentum=0.95)
    layouts = muon_layouts(model)
    params = {n: p for n, p in model.named_parameters() if layouts.get(n, (A,))[0] == "muon"}
    grads = []
    for seed in (0, 1):
        model(**batch(seed)).loss.backward()
        grads.append({n: p.grad.clone() for n, p in params.items()})
        before = {n: p.detach().clone() for n, p in params.items()}
        opt.step()
        opt.zero_grad()
    checked = 0
    for n, p in params.items():
        g1, g2 = grads[0][n], grads[1][n]
        momentum = g2.add(g1.mul(0.95).add(g2), alpha=0.95)
        update = before[n] - p.detach()
        for u, m in zip(blocks_of(update, layouts[n]), blocks_of(momentum, layouts[n])):
            ref = ns5(m) * 0.2 * math.sqrt(max(m.shape))
            assert torch.allclose(u, ref, atol=1e-5, rtol=1e-4), n
            checked += 1
        if layouts[n].blocks in ("rows", "cols"):
            whole = ns5(momentum) * 0.2 * math.sqrt(max(m.shape))
            assert (update - whole).abs().max() > 0.05, f"{n}: the per-head update equals the whole-matrix one"
    assert checked == 56  # 16 blocks in layer 0 (KDA, dense MLP), 40 in layer 1 (MLA, 8 experts)


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (32, 32), (8, 256)])
def test_update_rms_is_adamw_like_whatever_the_block_shape(shape):
    """0.2 * sqrt(max(rows, cols)) makes an orthogonalised block's RMS ~0.2 for any shape (NS5 leaves singular
    values in ~[0.7, 1.2]; observed 0.172-0.215): without sqrt(max) a [8, 256] block would get RMS 0.2 / 16."""
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = PerHeadMuon([p], lr=1.0, weight_decay=0.0)
    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    opt.step()
    rms = float(p.detach().pow(2).mean().sqrt())
    assert 0.15 < rms < 0.25, rms


def test_weight_decay_is_decoupled():
    """Zero gradients: the Muon and 2-D AdamW parameters shrink by exactly (1 - lr*wd) (an L2 term added to the
    gradient would be orthogonalised into a full-size step instead), 1-D ones do not move."""
    model = tiny_model(**SMALL).train()
    lr, wd = 0.5, 0.1
    opt = build_per_head_muon(model, lr=lr, weight_decay=wd)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()
    for g in opt.param_groups:
        for n, p in zip(g["param_names"], g["params"]):
            want = before[n] if p.dim() < 2 else before[n] * (1 - lr * wd)
            assert torch.equal(p.detach(), want), n


def test_adamw_groups_step_exactly_as_torch_adamw():
    ps = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in
          enumerate([(96, 64), (64,), (32, 1, 4)])]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = PerHeadMuon([dict(params=ps, algorithm="adamw")], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    theirs = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(3):
        for i, (p, q) in enumerate(zip(ps, ref)):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ps, ref):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------- checkpoints, dtypes, Trainer
def snapshot(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def restore(data, seed, load_optimizer=True):
    """A fresh model (other initial weights) and optimizer given the snapshot's weights and optimizer state."""
    saved = torch.load(io.BytesIO(data), weights_only=True)
    model = tiny_model(seed=seed, **SMALL).train()
    model.load_state_dict(saved["model"])
    opt = build_per_head_muon(model, lr=1e-2)
    if load_optimizer:
        opt.load_state_dict(saved["opt"])
    return model, opt


def test_resume_from_state_dict_is_bit_identical():
    model = tiny_model(**SMALL).train()
    opt = build_per_head_muon(model, lr=1e-2)
    for seed in (0, 1):
        train_step(model, opt, seed)
    data = snapshot(model, opt)
    for seed in (2, 3):
        train_step(model, opt, seed)

    resumed, opt2 = restore(data, seed=5)
    assert [g["blocks"] for g in opt2.param_groups] == [g["blocks"] for g in opt.param_groups]
    for seed in (2, 3):
        train_step(resumed, opt2, seed)
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n

    fresh, opt3 = restore(data, seed=5, load_optimizer=False)  # the state matters: without it the run differs
    train_step(fresh, opt3, 2)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_bf16_parameters_train():
    model = tiny_model(**SMALL).train().to(torch.bfloat16)
    opt = build_per_head_muon(model, lr=1e-2)
    losses = [train_step(model, opt, 0) for _ in range(3)]
    assert losses[-1] < losses[0] - 0.05, losses
    for g in opt.param_groups:
        for p in g["params"]:
            assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()
            assert all(t.dtype == torch.bfloat16 for k, t in opt.state[p].items() if k != "step")


def test_trainer_with_scheduler_and_gradient_accumulation_reduces_the_loss(tmp_path):
    torch.manual_seed(0)
    docs = []
    for _ in range(16):  # arithmetic sequences: the next token follows from the previous two
        s, step = int(torch.randint(0, 93, (1,))), int(torch.randint(1, 3, (1,)))
        ids = ((s + step * torch.arange(16)) % 93 + 3).tolist()
        docs.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)})
    model = tiny_model(**SMALL).train()
    opt = build_per_head_muon(model, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))  # lr/2, then lr
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=6, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=docs, optimizers=(opt, sched))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.5, logs
    assert logs[0]["learning_rate"] == 5e-3 and {g["lr"] for g in opt.param_groups} == {1e-2}  # our schedule


# ----------------------------------------------------------------------------- DTensor (FSDP2) parameters
def run_on_thread_ranks(world_size, fn):
    """fn(rank) on `world_size` threads, each a rank of a threaded process group (torch's own DTensor tests use it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    results, store = {}, dist.HashStore()

    def worker(rank):
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # reported by the main thread
            results[rank] = e
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    for r in range(world_size):
        if isinstance(results.get(r), BaseException):
            raise results[r]
    return results


def sharded_case():
    """A whole matrix, an o_proj-like matrix split by input columns and a norm gain: Shard(0) cuts across their
    blocks, so orthogonalising each rank's shard alone would give another update."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 24), (24, 32), (32,)]
    weights = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
    return weights, grads


def sharded_groups(ps):
    return [dict(params=[ps[0]]), dict(params=[ps[1]], blocks="cols", block_size=8),
            dict(params=[ps[2]], algorithm="adamw")]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_dtensor_sharded_parameters_step_as_unsharded_ones():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    weights, grads = sharded_case()

    def on_rank(rank):
        mesh = init_device_mesh("cpu", (2,))
        ps = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
        opt = PerHeadMuon(sharded_groups(ps), lr=0.1)
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            opt.step()
        assert isinstance(opt.state[ps[0]]["momentum_buffer"], DTensor)
        assert ps[0].to_local().shape == (16, 24)
        return [p.full_tensor().clone() for p in ps]

    results = run_on_thread_ranks(2, on_rank)
    ps = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = PerHeadMuon(sharded_groups(ps), lr=0.1)
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.clone()
        opt.step()
    for rank in (0, 1):
        for got, want in zip(results[rank], ps):
            assert torch.equal(got, want.detach())


def test_a_misshapen_group_is_refused_naming_the_parameter():
    with pytest.raises(ValueError, match="q_proj.weight: dim 0 of shape \\[30, 8\\] does not split into heads of 16"):
        PerHeadMuon([dict(params=[("q_proj.weight", torch.nn.Parameter(torch.zeros(30, 8)))], blocks="rows",
                          block_size=16)])
    with pytest.raises(ValueError, match="norm.weight: Muon with blocks='whole' needs a 2-D weight"):
        PerHeadMuon([("norm.weight", torch.nn.Parameter(torch.zeros(8)))])
