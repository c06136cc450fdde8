"""Distributed fine-tuning (`transformers_kimi3.distributed`, FSDP2) on two CPU processes with gloo, against one
process on the same global batch: full fine-tuning with AdamW and with Per-Head Muon (its update of sharded
momentum, whole blocks kept on their shards), a bf16 model with its fp32-kept parameters and a bf16
MixedPrecisionPolicy, LoRA on packed MXFP4 experts (buffers) under activation checkpointing, the full state dict
gathered to rank 0, `save_pretrained_fsdp2`, an official-layout file loaded into a model built on the meta device, a
sharded torch.distributed.checkpoint resume of model and Muon state, Transformers' own FSDP2 + expert parallel, and
quantisation-aware training (`prepare_qat`, then `apply_fsdp2`): its masters saved whole and resumed into shards, and
its packed folder.

One spawn (fork: the parent's imports are reused) runs every check; the tests read its results. Each rank trains on
half of every batch; FSDP2 averages the two halves' gradients, so the reference is one process accumulating the same
two halves (each loss divided by 2): that is the same global batch, and the same arithmetic in the same order, so the
results are compared at 1e-6 relative (observed: bit-identical). The whole batch in one backward differs from the
halves by fp32 rounding; it is compared at the first step's gradients only (an update can then flip a token's
expert choice, which AdamW and Muon turn into visibly different weights)."""

import json
import os

import pytest
import torch

from kimi3_testing import ROOT, tiny_model

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

WORLD, STEPS, LR = 2, 3, 1e-2
TOL = 1e-6  # same arithmetic in the same order: observed 0
WHOLE_TOL = 5e-6  # first-step gradients of the whole batch in one backward vs the halves (fp32 rounding)
HALVES = [slice(rank, None, WORLD) for rank in range(WORLD)]
ASSET = os.path.join(ROOT, "assets", "kimi-k3-tiny")  # K3 with a vision tower and packed MXFP4 experts
# 2 layers: KDA + dense MLP, MLA + latent MoE (shared expert); AttnRes blocks of 1
SMALL = dict(num_hidden_layers=2, attn_res_block_size=1,
             linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                     use_full_rank_gate=True, kda_layers=[1], full_attn_layers=[2]))
LORA = dict(r=4, lora_alpha=8, target_modules=["experts", "q_proj", "kv_b_proj", "o_proj"])


def _batch(step):
    return torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(100 + step))


def _small():
    return tiny_model(**SMALL).train()


def _bf16(model):
    """The model in bf16 with the parameters and buffers Kimi models keep in fp32 (A_log, dt_bias, KDA convs,
    o_norm, the routers' correction bias) left in fp32, as from_pretrained(..., dtype=torch.bfloat16) loads it."""
    keep = set(model._keep_in_fp32_modules_strict)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not keep & set(name.split(".")):
            t.data = t.data.to(torch.bfloat16)
    return model


def _optimizer(kind, model):
    from transformers_kimi3 import build_per_head_muon

    if kind == "muon":
        return build_per_head_muon(model, lr=LR)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _packed_small():
    """The 2-layer model with its routed experts packed to MXFP4 buffers, as a packed checkpoint loads them."""
    from transformers_kimi3.moe import Kimi3SparseMoeBlock
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    model = _small()
    for block in model.modules():
        if isinstance(block, Kimi3SparseMoeBlock):
            block.experts = PackedMXFP4Experts.from_experts(block.experts)
    return model


def _lora_model():
    from peft import get_peft_model

    from transformers_kimi3.expert_lora import packed_experts_lora_config

    base = _packed_small()
    base.activation_checkpointing_enable()
    torch.manual_seed(0)  # LoRA's A draws
    return get_peft_model(base, packed_experts_lora_config(**LORA)).train()


def _train(model, opt, parts, steps=STEPS, first=0, on_grads=None):
    """Per step: one backward per batch part (loss / number of parts), then the optimizer. Returns the losses (sum
    over parts; under FSDP2 also averaged over the ranks)."""
    losses = []
    for step in range(first, first + steps):
        total = torch.zeros(())
        for rows in parts:
            x = _batch(step)[rows]
            loss = model(input_ids=x, labels=x).loss / len(parts)
            loss.backward()
            total += loss.detach()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        if on_grads is not None and step == first:
            on_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses


# ----------------------------------------------------------------------------- the two ranks
def _full_grads(model):
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def _run_full(kind, rank, folder, out):
    """Full fine-tuning under FSDP2: losses, first-step gradients, gathered state dict, save_pretrained_fsdp2.
    Muon also saves model and optimizer with torch.distributed.checkpoint after step 2 (for `_resume`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from transformers_kimi3 import muon
    from transformers_kimi3.distributed import apply_fsdp2, gather_full_state_dict, save_pretrained_fsdp2

    model = apply_fsdp2(_small())
    opt = _optimizer(kind, model)
    grads = {}
    gathers = []
    if kind == "muon":  # count the Muon parameters whose momentum is gathered (the others stay on their shards)
        full = muon._full
        muon._full = lambda t: gathers.append(t.shape) or full(t)
    try:
        losses = _train(model, opt, [HALVES[rank]], steps=STEPS - 1,
                        on_grads=lambda m: grads.update(_full_grads(m)))
        if kind == "muon":
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=os.path.join(folder, "dcp"))
        losses += _train(model, opt, [HALVES[rank]], steps=1, first=STEPS - 1)
    finally:
        if kind == "muon":
            muon._full = full
    state = gather_full_state_dict(model)
    save_pretrained_fsdp2(model, os.path.join(folder, f"{kind}-model"))
    out[kind] = dict(losses=losses, grads=grads, state=state, gathers=len(gathers))
    if kind == "muon":
        layouts = muon.muon_layouts(model)
        params = dict(model.named_parameters())
        out["muon_local"] = {n for n, lay in layouts.items() if lay.algorithm == "muon"
                             and muon._local_blocks(params[n], lay)}
        out["muon_count"] = sum(lay.algorithm == "muon" for lay in layouts.values())
    return model


def _load_on_meta(rank, folder, out, trained):
    """Every rank builds the model on the meta device and shards it; rank 0 reads the saved official-layout file,
    and load_full_state_dict converts and broadcasts it. The loaded model's logits equal the trained model's."""
    from safetensors.torch import load_file

    from transformers_kimi3 import Kimi3ForCausalLM
    from transformers_kimi3.distributed import apply_fsdp2, load_full_state_dict

    with torch.device("meta"):
        fresh = Kimi3ForCausalLM(trained.config)
    apply_fsdp2(fresh)
    fresh.to_empty(device="cpu")
    official = load_file(os.path.join(folder, "adamw-model", "model.safetensors")) if rank == 0 else {}
    load_full_state_dict(fresh, official)
    x = _batch(9)[HALVES[rank]]
    with torch.no_grad():
        out[f"meta_load_logits_diff{rank}"] = float((fresh.eval()(input_ids=x).logits
                                                     - trained.eval()(input_ids=x).logits).abs().max())
    out["official_layout"] = rank != 0 or set(official) != set(trained.state_dict())
    # generate() on the sharded model, each rank its own prompt and length: Transformers sees FSDP and keeps the
    # ranks' forwards in step (synced_gpus) until the longest finishes
    with torch.no_grad():
        out[f"generated{rank}"] = fresh.generate(_batch(9)[HALVES[rank], :6], **_generate_kwargs(rank))


def _generate_kwargs(rank):
    return dict(max_new_tokens=3 + 3 * rank, do_sample=False, pad_token_id=0, eos_token_id=2)


def _resume(rank, folder, out):
    """The checkpoint of Muon's step 2 (torch.distributed.checkpoint: sharded model and optimizer state) loaded into
    a model with other initial weights and a new optimizer, then step 3; vs the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from transformers_kimi3.distributed import apply_fsdp2, gather_full_state_dict

    model = apply_fsdp2(tiny_model(seed=1, **SMALL).train())
    opt = _optimizer("muon", model)
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, opt, [HALVES[rank]], steps=1, first=STEPS - 1)
    out["resumed"] = gather_full_state_dict(model)


def _run_bf16(rank, out):
    """A bf16 model with its fp32-kept parameters (FSDP2 needs one dtype per unit: apply_fsdp2 gives those their
    own units) trains 2 AdamW steps; an fp32 model under a bf16 MixedPrecisionPolicy computes its projections in
    bf16 and A_log, dt_bias, the convs in fp32 (the dtypes seen inside the forward are recorded)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from transformers_kimi3.distributed import apply_fsdp2, gather_full_state_dict

    model = apply_fsdp2(_bf16(_small()))
    opt = _optimizer("adamw", model)
    out["bf16"] = dict(losses=_train(model, opt, [HALVES[rank]], steps=2), state=gather_full_state_dict(model))

    model = _small()
    seen = {}
    kda = model.model.layers[0].self_attn
    kda.register_forward_hook(lambda m, args, y: seen.update(A_log=m.A_log.dtype, conv=m.q_conv1d.weight.dtype,
                                                             dt_bias=m.dt_bias.dtype, x=args[0].dtype))
    kda.q_proj.register_forward_hook(lambda m, args, y: seen.update(q_proj=m.weight.dtype))
    model.model.layers[1].self_attn.kv_b_proj.register_forward_hook(
        lambda m, args, y: seen.update(kv_b_proj=m.weight.dtype))
    apply_fsdp2(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = _batch(0)[HALVES[rank]]
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    out["mp"] = dict(loss=float(loss) / WORLD, seen=seen, grad_dtype=model.lm_head.weight.grad.dtype)


def _run_lora(rank, folder, out):
    from transformers_kimi3.distributed import apply_fsdp2, fsdp2_units, gather_full_state_dict, save_pretrained_fsdp2

    model = _lora_model()
    units = {type(m).__name__ for m in fsdp2_units(model)}
    apply_fsdp2(model)
    opt = _optimizer("adamw", model)
    out["lora"] = dict(losses=_train(model, opt, [HALVES[rank]]), state=gather_full_state_dict(model), units=units)
    save_pretrained_fsdp2(model, os.path.join(folder, "adapter"))


# (layout, shape): whether each rank's shard (2 ranks, dim 0) holds whole blocks
BLOCK_CASES = [(("rows", 16), (64, 8), True), (("rows", 16), (48, 8), False), (("experts", None), (3, 4, 6), True),
               (("experts", None), (1, 4, 6), True), (("cols", 16), (8, 32), False), (("whole", None), (8, 8), False)]


def _muon_blocks(rank, out):
    """Per-Head Muon's update of a DTensor momentum sharded on dim 0 (uneven shards and an empty one included),
    on the shards where they hold whole blocks, else gathered: vs the update of the whole tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from transformers_kimi3.muon import Layout, _local_blocks, _update, muon_update

    mesh = init_device_mesh("cpu", (WORLD,))
    results = []
    for (blocks, size), shape, _ in BLOCK_CASES:
        layout = Layout("muon", blocks, size)
        full = torch.randn(shape, generator=torch.Generator().manual_seed(len(results)))
        m = distribute_tensor(full, mesh, [Shard(0)])
        got = _update(m, layout, 5, m).full_tensor()
        results.append((_local_blocks(m, layout), float((got - muon_update(full, layout)).abs().max())))
    out["blocks"] = results


def _run_ep(rank, folder, out):
    """Transformers' own expert parallel with FSDP2 (`DistributedConfig(fsdp_size=2, ep_size=2)`: the config's
    `base_model_ep_plan`, whole experts per rank, tokens exchanged by all-to-all), one forward and backward on each
    rank's half batch: the gradients, routed experts' included, gathered whole."""
    from transformers.distributed import DistributedConfig

    from transformers_kimi3 import Kimi3ForCausalLM

    config = DistributedConfig(fsdp_size=WORLD, ep_size=WORLD)
    model = Kimi3ForCausalLM.from_pretrained(os.path.join(folder, "small"), distributed_config=config).train()
    w1 = model.model.layers[1].block_sparse_moe.experts.w1
    x = _batch(0)[HALVES[rank]]
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    out["ep"] = dict(loss=float(loss) / WORLD, grads=_full_grads(model), w1_local=tuple(w1.to_local().shape))


# ----------------------------------------------------------------------------- QAT (prepare_qat, then apply_fsdp2)
QAT_CKPT = "qat-run/checkpoint-2"


def _qat_small(seed=0):
    from transformers_kimi3 import prepare_qat

    return prepare_qat(tiny_model(seed=seed, **SMALL).train())


def _qat_args(folder, rank):
    """What QATMastersCallback reads of TrainingArguments: rank 0 writes the checkpoint (`should_save`)."""
    from types import SimpleNamespace

    return SimpleNamespace(output_dir=os.path.join(folder, "qat-run"), should_save=rank == 0,
                           resume_from_checkpoint=os.path.join(folder, QAT_CKPT))


def _qat_resume(rank, folder, load_masters):
    """A fresh sharded QAT model (other initial weights) given the step-2 checkpoint: the packed folder
    (load_full_state_dict: the masters hold its quantised values), the AdamW state (dcp) and, with load_masters, the
    exact masters (QATMastersCallback.on_train_begin); then step 3."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from transformers import TrainerControl, TrainerState

    from transformers_kimi3 import QATMastersCallback
    from transformers_kimi3.distributed import apply_fsdp2, gather_full_state_dict, load_full_state_dict

    checkpoint = os.path.join(folder, QAT_CKPT)
    model = apply_fsdp2(_qat_small(seed=1))
    load_full_state_dict(model, load_file(os.path.join(checkpoint, "model.safetensors")) if rank == 0 else {})
    opt = _optimizer("adamw", model)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, "optim"))
    set_optimizer_state_dict(model, opt, state["optim"])
    callback = QATMastersCallback()
    if load_masters:
        callback.on_train_begin(_qat_args(folder, rank), TrainerState(global_step=2), TrainerControl(), model=model)
    _train(model, opt, [HALVES[rank]], steps=1, first=2)
    return gather_full_state_dict(model), callback.loaded


def _run_qat(rank, folder, out):
    """QAT under FSDP2 as a user runs it: prepare_qat, apply_fsdp2, AdamW; 2 steps; the checkpoint of step 2
    (save_pretrained_fsdp2's packed folder, QATMastersCallback.on_save's masters, the optimizer with dcp); step 3;
    the packed folder of the trained model; resumes from the checkpoint with and without the masters; refusals."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor
    from transformers import TrainerControl, TrainerState

    from transformers_kimi3 import QATMastersCallback, prepare_qat
    from transformers_kimi3.distributed import apply_fsdp2, fsdp2_units, gather_full_state_dict, save_pretrained_fsdp2
    from transformers_kimi3.qat import QAT_MASTERS_NAME, load_qat_masters, qat_masters

    model = _qat_small()
    units = [type(m).__name__ for m in fsdp2_units(model)]
    apply_fsdp2(model)
    masters = qat_masters(model)
    opt = _optimizer("adamw", model)
    losses = _train(model, opt, [HALVES[rank]], steps=2)
    checkpoint = os.path.join(folder, QAT_CKPT)
    save_pretrained_fsdp2(model, checkpoint)  # Trainer's checkpoint: the masters packed
    QATMastersCallback().on_save(_qat_args(folder, rank), TrainerState(global_step=2), TrainerControl(), model=model)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(checkpoint, "optim"))
    masters2 = {n: p.full_tensor() for n, p in masters.items()}
    losses += _train(model, opt, [HALVES[rank]], steps=1, first=2)
    save_pretrained_fsdp2(model, os.path.join(folder, "qat-packed"))
    model.eval()
    with torch.no_grad():  # the sharded model's eval forward: each rank its half of the batch
        out[f"qat_logits{rank}"] = model(input_ids=_batch(9)[HALVES[rank]]).logits
    state = gather_full_state_dict(model)
    out["qat"] = dict(units=units, local=tuple(next(iter(masters.values())).to_local().shape), losses=losses,
                      masters2=masters2, state=state)
    out["qat_resumed"], out["qat_loaded"] = _qat_resume(rank, folder, load_masters=True)
    out["qat_not_loaded"], _ = _qat_resume(rank, folder, load_masters=False)

    # the trained model's masters with one master's values moved in rank 1's shard only (experts 4..7): both ranks
    # refuse the file (rank 0 naming rank 1), and neither changes a master
    bad = os.path.join(folder, "qat-bad")
    if rank == 0:
        os.makedirs(bad)
        tensors = {n: state[n].clone() for n in masters}
        tensors[next(n for n in tensors if n.endswith("experts.w1"))][4:] += 1
        save_file(tensors, os.path.join(bad, QAT_MASTERS_NAME))
    dist.barrier()
    before = {n: p.to_local().clone() for n, p in masters.items()}
    try:
        load_qat_masters(model, bad)
        out[f"qat_refusal{rank}"] = None
    except ValueError as e:
        out[f"qat_refusal{rank}"] = str(e)
    out[f"qat_refusal_unchanged{rank}"] = all(torch.equal(p.to_local(), before[n]) for n, p in masters.items())
    try:  # the other order
        prepare_qat(apply_fsdp2(_small()))
        out["qat_other_order"] = None
    except ValueError as e:
        out["qat_other_order"] = str(e)

    # a bf16 model with fp32 masters (units of one dtype each), 2 steps; and an fp32 QAT model under a bf16
    # MixedPrecisionPolicy: the masters reach the forward uncast
    model = prepare_qat(_bf16(_small()), master_dtype=torch.float32)
    apply_fsdp2(model)
    out["qat_bf16"] = dict(losses=_train(model, _optimizer("adamw", model), [HALVES[rank]], steps=2),
                           state=gather_full_state_dict(model))
    model = _qat_small()
    seen = {}
    model.model.layers[1].block_sparse_moe.experts.register_forward_pre_hook(  # runs after FSDP2's unshard
        lambda m, args: seen.update(w1=m.w1.dtype, sharded=isinstance(m.w1, DTensor), x=args[0].dtype))
    apply_fsdp2(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = _batch(0)[HALVES[rank]]
    model(input_ids=x, labels=x).loss.backward()
    out["qat_mp"] = dict(seen=seen, grad_dtype=model.model.layers[1].block_sparse_moe.experts.w1.grad.dtype)


def _worker(rank, folder):
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        out = {}
        trained = _run_full("adamw", rank, folder, out)
        _load_on_meta(rank, folder, out, trained)
        _run_full("muon", rank, folder, out)
        _resume(rank, folder, out)
        _run_bf16(rank, out)
        _run_lora(rank, folder, out)
        _run_ep(rank, folder, out)
        _muon_blocks(rank, out)
        _run_qat(rank, folder, out)
        if rank == 1:
            torch.save({k: v for k, v in out.items() if k.endswith("1")}, os.path.join(folder, "rank1.pt"))
        dist.barrier()
        if rank == 0:  # last: its presence marks a complete run
            torch.save(out, os.path.join(folder, "results.pt"))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The two ranks' results, computed once per test run: under pytest-xdist the workers share one folder and a
    lock, so the second worker to get here reads what the first computed."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder, above the workers'
    folder = shared / "fsdp2"
    with FileLock(str(shared / "fsdp2.lock")):
        if not (folder / "results.pt").exists():
            folder.mkdir(exist_ok=True)
            # imported once here: the forked workers inherit them instead of each importing them on the shared cores
            import peft  # noqa: F401
            import torch.distributed.checkpoint as _dcp  # noqa: F401
            import torch.distributed.fsdp as _fsdp  # noqa: F401

            import transformers_kimi3.distributed  # noqa: F401
            import transformers_kimi3.expert_lora  # noqa: F401
            import transformers_kimi3.qat  # noqa: F401

            _small().save_pretrained(folder / "small")  # for Transformers' own distributed loading (_run_ep)
            mp.start_processes(_worker, args=(str(folder),), nprocs=WORLD, start_method="fork")
    out = torch.load(folder / "results.pt", weights_only=False)
    out.update(torch.load(folder / "rank1.pt"))
    out["folder"] = folder
    return out


def _reference(kind):
    model = _small()
    grads = {}
    losses = _train(model, _optimizer(kind, model), HALVES,
                    on_grads=lambda m: grads.update({n: p.grad.clone() for n, p in m.named_parameters()
                                                     if p.grad is not None}))
    return model, losses, grads


def _max_rel(got, ref):
    return max(float((got[n] - ref[n]).abs().max()) / max(float(ref[n].abs().max()), 1e-12) for n in ref)


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_fsdp2_training_equals_one_process(ranks, kind):
    """3 steps of AdamW / Per-Head Muon (lr 1e-2) on a 2-layer K3 (KDA, MLA, dense MLP, latent MoE, AttnRes):
    losses, first-step gradients and final weights and buffers (gathered to rank 0) equal one process."""
    from transformers_kimi3 import Kimi3ForCausalLM

    got = ranks[kind]
    model, losses, grads = _reference(kind)
    ref = model.state_dict()
    assert got["state"].keys() == ref.keys()
    assert max(abs(a - b) / b for a, b in zip(got["losses"], losses)) <= TOL, (got["losses"], losses)
    assert got["grads"].keys() == grads.keys() and _max_rel(got["grads"], grads) <= TOL
    assert _max_rel(got["state"], ref) <= TOL
    assert _max_rel(got["state"], _small().state_dict()) > 1e-3  # the weights did move

    whole = _small()
    whole_grads = {}
    _train(whole, _optimizer(kind, whole), [slice(None)], steps=1,
           on_grads=lambda m: whole_grads.update({n: p.grad.clone() for n, p in m.named_parameters()
                                                  if p.grad is not None}))
    assert _max_rel(got["grads"], whole_grads) <= WHOLE_TOL

    # save_pretrained_fsdp2 wrote the official layout; from_pretrained gives the trained weights. The folder's remote
    # code is the Kimi classes' (not torch's FSDP subclass of the model's class and its modules)
    folder = ranks["folder"] / f"{kind}-model"
    saved = Kimi3ForCausalLM.from_pretrained(folder).state_dict()
    assert _max_rel(saved, ref) <= TOL
    auto_map = json.load(open(folder / "config.json"))["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_kimi3.Kimi3ForCausalLM", auto_map
    assert "modeling_kimi3.py" in os.listdir(folder) and not any("fsdp" in n for n in os.listdir(folder))


def test_per_head_muon_keeps_whole_blocks_on_their_shards(ranks):
    """Routed experts (sharded on their expert dim) and KDA / MLA head rows (a shard holds whole heads) are
    orthogonalised where they are; only the other Muon matrices are gathered, once per step each."""
    local = ranks["muon_local"]
    for name in ("experts.w1", "experts.w2", "experts.w3", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight"):
        assert any(n.endswith(name) for n in local), name
    assert not any(n.endswith(("o_proj.weight", "mlp.gate_proj.weight")) for n in local)
    assert ranks["muon"]["gathers"] == STEPS * (ranks["muon_count"] - len(local))


def test_bf16_model_and_mixed_precision_policy(ranks):
    """bf16 weights with fp32 A_log / dt_bias / convs / o_norm: 2 AdamW steps equal one process. A bf16
    MixedPrecisionPolicy on fp32 shards: projections compute in bf16, the fp32-kept parameters in fp32, gradients
    are reduced in fp32, and the loss equals one process computing with the same bf16 weights."""
    model = _bf16(_small())
    losses = _train(model, _optimizer("adamw", model), HALVES, steps=2)
    got = ranks["bf16"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], losses)) <= TOL, (got["losses"], losses)
    ref = model.state_dict()
    assert {t.dtype for t in got["state"].values()} == {torch.bfloat16, torch.float32}
    assert all(got["state"][n].dtype == t.dtype for n, t in ref.items())
    assert _max_rel(got["state"], ref) <= TOL

    mp = ranks["mp"]
    assert mp["seen"] == dict(A_log=torch.float32, conv=torch.float32, dt_bias=torch.float32, x=torch.bfloat16,
                              q_proj=torch.bfloat16, kv_b_proj=torch.bfloat16)
    assert mp["grad_dtype"] == torch.float32
    model = _bf16(_small())
    with torch.no_grad():
        loss = sum(float(model(input_ids=_batch(0)[rows], labels=_batch(0)[rows]).loss) for rows in HALVES) / WORLD
    assert abs(mp["loss"] - loss) <= TOL * loss, (mp["loss"], loss)


def test_per_head_muon_update_of_sharded_momentum(ranks):
    """Heads that a shard boundary does not cut, experts on uneven shards (3 on 2 ranks) and on an empty shard (1 on
    2 ranks) are updated on their shards; cut heads, column heads and whole matrices are gathered. Either way the
    update equals that of the whole tensor (the same bf16 Newton-Schulz per block: observed 0)."""
    assert [local for local, _ in ranks["blocks"]] == [want for _, _, want in BLOCK_CASES]
    assert all(diff <= 1e-6 for _, diff in ranks["blocks"]), ranks["blocks"]


def test_sharded_checkpoint_resume_of_model_and_muon_state(ranks):
    """2 steps, torch.distributed.checkpoint save, load into a model with other weights and a new optimizer, 1 step:
    equals 3 uninterrupted steps."""
    assert ranks["resumed"].keys() == ranks["muon"]["state"].keys()
    assert _max_rel(ranks["resumed"], ranks["muon"]["state"]) <= TOL


def test_official_layout_loads_into_a_meta_built_sharded_model(ranks):
    """save_pretrained_fsdp2's file (the official layout: per-expert tensors) read by rank 0 alone, converted and
    broadcast into a model every rank built on the meta device and sharded: the trained model's logits exactly."""
    assert ranks["official_layout"]
    for rank in range(WORLD):
        assert ranks[f"meta_load_logits_diff{rank}"] == 0.0


def test_generate_on_the_sharded_model(ranks):
    """Each rank generates from its own prompt with its own length (3 and 6 new tokens): the tokens of one process."""
    from transformers_kimi3 import Kimi3ForCausalLM

    model = Kimi3ForCausalLM.from_pretrained(ranks["folder"] / "adamw-model").eval()
    for rank in range(WORLD):
        with torch.no_grad():
            ref = model.generate(_batch(9)[HALVES[rank], :6], **_generate_kwargs(rank))
        assert ref.shape[1] == 6 + 3 + 3 * rank and torch.equal(ranks[f"generated{rank}"], ref)


def test_lora_on_packed_experts_under_fsdp2(ranks):
    """PEFT LoRA (packed MXFP4 experts through PackedExpertsLoraLayer, MLA / KDA projections) with gradient
    checkpointing: losses and adapter weights equal one process, the frozen base weights and packed experts are
    unchanged, and the adapter saved by save_pretrained_fsdp2 reloads with the same logits."""
    from transformers_kimi3.expert_lora import load_packed_experts_adapter

    got = ranks["lora"]
    assert got["units"] == {"Kimi3DecoderLayer", "Embedding", "Kimi3LMHead"}
    model = _lora_model()
    losses = _train(model, _optimizer("adamw", model), HALVES)
    ref = model.state_dict()
    assert got["state"].keys() == ref.keys()
    assert max(abs(a - b) / b for a, b in zip(got["losses"], losses)) <= TOL, (got["losses"], losses)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert _max_rel({n: got["state"][n] for n in trained}, {n: ref[n] for n in trained}) <= TOL
    initial = _lora_model().state_dict()
    frozen = [n for n in ref if n not in trained]
    assert any(n.endswith("experts.base_layer.w1_packed") for n in frozen)  # packed MXFP4 buffers
    assert all(torch.equal(got["state"][n], initial[n]) for n in frozen)
    assert _max_rel({n: got["state"][n] for n in trained}, {n: initial[n] for n in trained}) > 1e-3

    reloaded = load_packed_experts_adapter(_packed_small(), str(ranks["folder"] / "adapter")).eval()
    x = _batch(9)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, model.eval()(input_ids=x).logits)


def test_expert_parallel_training_equals_one_process(ranks):
    """FSDP2 + expert parallel through Transformers (each rank holds 4 of the 8 experts of each MoE layer): the mean
    loss and every gradient, routed experts' included, equal one process on the whole batch within fp32 rounding."""
    got = ranks["ep"]
    assert got["w1_local"] == (4, 32, 32)
    model = _small()
    x = _batch(0)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(got["loss"] - float(loss.detach())) <= WHOLE_TOL * float(loss.detach())
    assert got["grads"].keys() == grads.keys() and any(n.endswith("experts.w2") for n in grads)
    assert _max_rel(got["grads"], grads) <= WHOLE_TOL


def test_units_and_argument_errors():
    """The units: decoder layers, then the embedding and the head (unless tied); in the K3 model with a vision tower
    (the bundled tiny checkpoint) the vision blocks too. Wrong arguments are refused, naming them."""
    from transformers import AutoModelForCausalLM

    from transformers_kimi3.distributed import apply_fsdp2, fsdp2_units

    model = tiny_model(**SMALL)
    assert [type(u).__name__ for u in fsdp2_units(model)] == ["Kimi3DecoderLayer"] * 2 + ["Embedding", "Kimi3LMHead"]
    tied = tiny_model(tie_word_embeddings=True, **SMALL)  # a tied embedding and head stay in the root unit
    assert [type(u).__name__ for u in fsdp2_units(tied)] == ["Kimi3DecoderLayer"] * 2
    k3 = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    units = fsdp2_units(k3)
    vision_blocks = [m for m in k3.vision_tower.modules() if type(m).__name__ == "Kimi3VisionBlock"]
    assert vision_blocks and units[-2:] == [k3.get_input_embeddings(), k3.get_output_embeddings()]
    assert units[:-2] == list(k3.language_model.model.layers) + vision_blocks or \
        units[:-2] == vision_blocks + list(k3.language_model.model.layers)

    with pytest.raises(ValueError, match="mesh=None needs an initialised default process group"):
        apply_fsdp2(model)
    with pytest.raises(TypeError, match="mesh must be"):
        apply_fsdp2(model, mesh="cpu")
    with pytest.raises(ValueError, match="_no_split_modules"):
        fsdp2_units(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- QAT under FSDP2
@pytest.fixture(scope="module")
def qat_reference():
    """One process: the QAT model trained 3 steps on the two halves of each batch, as the ranks; its masters after
    step 2 too."""
    from transformers_kimi3.qat import qat_masters

    model = _qat_small()
    opt = _optimizer("adamw", model)
    losses = _train(model, opt, HALVES, steps=2)
    masters2 = {n: p.detach().clone() for n, p in qat_masters(model).items()}
    losses += _train(model, opt, HALVES, steps=1, first=2)
    return model, losses, masters2


def _masters_of(state, model):
    from transformers_kimi3.qat import qat_masters

    return {n: state[n] for n in qat_masters(model)}


def test_qat_under_fsdp2_equals_one_process(ranks, qat_reference):
    """prepare_qat, then apply_fsdp2 (each QATExperts a unit of its own, 4 of the 8 experts per rank), 3 AdamW steps
    (lr 1e-2): losses, masters and every other weight gathered to rank 0 equal one process (1e-6; observed 0). The
    masters moved, off their MXFP4 grid."""
    from transformers_kimi3.qat import fake_quantize_mxfp4

    model, losses, _ = qat_reference
    got = ranks["qat"]
    assert got["units"] == ["QATExperts", "Kimi3DecoderLayer", "Kimi3DecoderLayer", "Embedding", "Kimi3LMHead"]
    assert got["local"] == (4, 32, 32)
    assert max(abs(a - b) / b for a, b in zip(got["losses"], losses)) <= TOL, (got["losses"], losses)
    ref = model.state_dict()
    masters = _masters_of(got["state"], model)
    assert got["state"].keys() == ref.keys() and len(masters) == 3
    assert _max_rel(masters, _masters_of(ref, model)) <= TOL and _max_rel(got["state"], ref) <= TOL
    assert _max_rel(masters, _masters_of(_qat_small().state_dict(), model)) > 1e-3
    assert all(not torch.equal(w, fake_quantize_mxfp4(w)) for w in masters.values())


def test_qat_masters_checkpoint_and_resume_under_fsdp2(ranks, qat_reference):
    """QATMastersCallback.on_save on both ranks (rank 0 with should_save) writes one qat_masters.safetensors: the
    whole masters of step 2 (8 experts), fp32, step 2 in its metadata, equal to one process's (1e-6). A fresh
    sharded QAT model with other weights given the checkpoint (save_pretrained_fsdp2's packed folder through
    load_full_state_dict, the AdamW state through dcp, the masters through on_train_begin: each rank its shard), then
    step 3: every weight and master bit-identical to the uninterrupted sharded run. Without the masters the resumed
    run starts from their quantised values, and every master ends elsewhere."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from transformers_kimi3.qat import QAT_MASTERS_NAME

    model, _, masters2 = qat_reference
    path = ranks["folder"] / QAT_CKPT / QAT_MASTERS_NAME
    saved = load_file(path)
    with safe_open(path, "pt") as f:
        assert f.metadata()["global_step"] == "2"
    assert saved.keys() == ranks["qat"]["masters2"].keys() == masters2.keys()
    assert all(t.shape == (8, 32, 32) and t.dtype == torch.float32 for t in saved.values())
    assert all(torch.equal(saved[n], t) for n, t in ranks["qat"]["masters2"].items())
    assert _max_rel(saved, masters2) <= TOL

    assert ranks["qat_loaded"] == str(path)
    want, resumed = ranks["qat"]["state"], ranks["qat_resumed"]
    assert resumed.keys() == want.keys() and all(torch.equal(resumed[n], want[n]) for n in want)
    not_loaded = _masters_of(ranks["qat_not_loaded"], model)
    assert all(not torch.equal(t, want[n]) for n, t in not_loaded.items())


def test_qat_packed_folder_from_fsdp2_reloads_the_qat_forward(ranks, qat_reference):
    """save_pretrained_fsdp2 of the trained sharded QAT model packs the masters to MXFP4 as the fake-quantised
    forward used them: the folder, reloaded in one process, gives the eval logits of the one-process QAT model and
    of the sharded model itself (fp32, relative error below 1e-6)."""
    from kimi3_testing import rel_err

    from transformers_kimi3 import Kimi3ForCausalLM
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    model = qat_reference[0].eval()
    packed = Kimi3ForCausalLM.from_pretrained(ranks["folder"] / "qat-packed", dtype=torch.float32).eval()
    assert isinstance(packed.model.layers[1].block_sparse_moe.experts, PackedMXFP4Experts)
    x = _batch(9)
    with torch.no_grad():
        got, want = packed(input_ids=x).logits, model(input_ids=x).logits
    assert rel_err(got, want) < 1e-6
    for rank in range(WORLD):
        assert rel_err(got[HALVES[rank]], ranks[f"qat_logits{rank}"]) < 1e-6
    with torch.no_grad():
        assert rel_err(_qat_small().eval()(input_ids=x).logits, want) > 1e-3  # training moved the logits


def test_qat_refusals_under_fsdp2(ranks):
    """A masters file that does not fit rank 1's shard only (one master moved in experts 4..7) is refused on both
    ranks, naming the tensor and the file (rank 0: as rank 1's refusal), and no rank changes a master. prepare_qat
    on a sharded model is refused, naming the order."""
    folder = str(ranks["folder"] / "qat-bad" / "qat_masters.safetensors")
    own = ranks["qat_refusal1"]
    assert own.startswith(folder) and "experts.w1 does not quantise to the model's weights" in own, own
    other = ranks["qat_refusal0"]
    assert other.startswith(f"load_qat_masters: rank 1 refused {folder}: ValueError: {own}"), other
    assert ranks["qat_refusal_unchanged0"] and ranks["qat_refusal_unchanged1"]
    assert "call prepare_qat first, then apply_fsdp2" in ranks["qat_other_order"]


def test_qat_bf16_model_with_fp32_masters_and_mixed_precision(ranks):
    """A bf16 model with fp32 masters (the QATExperts unit is fp32, the layer's bf16), 2 AdamW steps: losses and
    weights equal one process (1e-6). An fp32 QAT model under a bf16 MixedPrecisionPolicy: the experts get bf16
    inputs and their fp32 masters unsharded and uncast (so the forward quantises what save_pretrained packs), and
    the masters' gradients are fp32."""
    from transformers_kimi3 import prepare_qat

    model = prepare_qat(_bf16(_small()), master_dtype=torch.float32)
    losses = _train(model, _optimizer("adamw", model), HALVES, steps=2)
    got = ranks["qat_bf16"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], losses)) <= TOL, (got["losses"], losses)
    ref = model.state_dict()
    assert all(got["state"][n].dtype == t.dtype for n, t in ref.items())
    assert {t.dtype for t in _masters_of(got["state"], model).values()} == {torch.float32}
    assert _max_rel(got["state"], ref) <= TOL
    assert ranks["qat_mp"] == dict(seen=dict(w1=torch.float32, sharded=False, x=torch.bfloat16),
                                   grad_dtype=torch.float32)
