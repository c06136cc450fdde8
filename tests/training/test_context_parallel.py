"""Context parallel (`transformers_kimi3.context_parallel`) on two CPU processes with gloo, against one process on the
whole sequence: a 4-layer K3 (KDA, MLA, KDA, MLA; dense MLP then latent MoE; AttnRes blocks of 2), fp32, two rows
of 37 tokens split 19 + 18. Prefill logits, the training loss and every parameter's gradient (averaged over the
ranks, by hand and by FSDP2 under activation checkpointing) equal one process's within fp32 rounding; with the KDA
state or the conv halo not passed, rank 1's logits are far off; unsupported arguments are refused on every rank.

The pieces run KDA's chunked recurrence from a passed state (two chunks of 19 and 18 tokens where one process runs
one of 37) and sum attention and loss terms in another order, so they round differently: observed up to 3.9e-6 of a
gradient's largest value; with every fp32 computation switched to fp64 (a check outside the suite) they agree to
5e-15."""

import os

import pytest
import torch

from kimi3_testing import tiny_model

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

WORLD = 2
TOL = 1e-5  # relative to each tensor's largest value
CONFIG = dict(num_hidden_layers=4, attn_res_block_size=2,
              linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                      use_full_rank_gate=True, kda_layers=[1, 3], full_attn_layers=[2, 4]))
IDS = torch.randint(3, 96, (2, 37), generator=torch.Generator().manual_seed(0))
LABELS = IDS.clone()
LABELS[0, :5] = -100  # unlabelled positions count in neither the sum nor the mean


def _model():
    return tiny_model(**CONFIG).train()


def _averaged_grads(model):
    """Every parameter's gradient averaged over the ranks: FSDP2's (DTensor) gathered whole, replicas' by hand."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if hasattr(p.grad, "full_tensor"):
            grads[name] = p.grad.full_tensor()
        else:
            grads[name] = p.grad.clone()
            dist.all_reduce(grads[name])
            grads[name] /= WORLD
    return grads


def _zeroed(part):
    """Pieces.receive with the KDA state (part 0) or the conv halo (parts 1-3) replaced by zeros."""
    from transformers_kimi3.context_parallel import Pieces

    receive = Pieces.receive

    def patched(self, shapes, like, tracked):
        got = receive(self, shapes, like, tracked)
        return got if got is None else [torch.zeros_like(t) if (i == 0) == (part == "state") else t
                                        for i, t in enumerate(got)]
    return patched


def _worker(rank, folder):
    from transformers_kimi3.context_parallel import Pieces, context_parallel, shard_sequence
    from transformers_kimi3.distributed import apply_fsdp2

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        out = {}
        model = _model()
        with context_parallel(model):
            batch = shard_sequence(IDS, LABELS)
            with torch.no_grad():
                out["prefill"] = model.eval()(**batch).logits
                for part in ("state", "halo"):
                    receive, Pieces.receive = Pieces.receive, _zeroed(part)
                    try:
                        out[f"without_{part}"] = model(**batch).logits
                    finally:
                        Pieces.receive = receive
            loss = model.train()(**batch).loss
            loss.backward()
            out["loss"], out["grads"] = float(loss.detach()), _averaged_grads(model)
            errors, mask = [], torch.ones_like(batch["input_ids"])
            mask[1, 3] = rank == 0  # a pad in rank 1's piece only
            for kwargs in (dict(attention_mask=mask), dict(use_cache=True), dict(labels=batch["input_ids"])):
                try:
                    model(input_ids=batch["input_ids"], **kwargs)
                except ValueError as e:
                    errors.append(str(e))
            out["errors"] = errors

        model = _model()
        model.activation_checkpointing_enable()
        apply_fsdp2(model)
        with context_parallel(model):
            loss = model(**shard_sequence(IDS, LABELS)).loss
            loss.backward()
        out["fsdp2_loss"], out["fsdp2_grads"] = float(loss.detach()), _averaged_grads(model)
        out["inside_after_exit"] = model.model._context_parallel is not None
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results, computed once per test run (under pytest-xdist the first worker computes them)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "context_parallel"
    with FileLock(str(shared / "context_parallel.lock")):
        if not all((folder / f"rank{r}.pt").exists() for r in range(WORLD)):
            folder.mkdir(exist_ok=True)
            # imported once here: the forked workers inherit them instead of each importing them on the shared cores
            import torch.distributed.fsdp as _fsdp  # noqa: F401

            import transformers_kimi3.context_parallel  # noqa: F401
            import transformers_kimi3.distributed  # noqa: F401

            mp.start_processes(_worker, args=(str(folder),), nprocs=WORLD, start_method="fork")
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    model = _model()
    with torch.no_grad():
        logits = model.eval()(input_ids=IDS).logits
    loss = model.train()(input_ids=IDS, labels=LABELS).loss
    loss.backward()
    return dict(logits=logits, loss=float(loss.detach()), grads={n: p.grad for n, p in model.named_parameters()
                                                        if p.grad is not None})


def _rel(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def _max_rel(got, ref):
    assert got.keys() == ref.keys()
    return max(_rel(got[n], ref[n]) for n in ref)


def test_prefill_logits_equal_one_process(ranks, reference):
    """Each rank's logits are its piece (19 and 18 tokens) of one process's logits."""
    assert [r["prefill"].shape[1] for r in ranks] == [19, 18]
    assert _rel(torch.cat([r["prefill"] for r in ranks], dim=1), reference["logits"]) <= TOL


def test_training_loss_and_gradients_equal_one_process(ranks, reference):
    """Every rank's loss is one process's mean over the whole sequence; the gradients averaged over the ranks (by
    hand on replicas; by FSDP2 under activation checkpointing) are one process's, every parameter's."""
    for r in ranks:
        for key in ("loss", "fsdp2_loss"):
            assert abs(r[key] - reference["loss"]) <= TOL * reference["loss"], (key, r[key], reference["loss"])
    assert any(n.endswith("experts.w1") for n in reference["grads"])
    assert _max_rel(ranks[0]["grads"], reference["grads"]) <= TOL
    assert _max_rel(ranks[0]["fsdp2_grads"], reference["grads"]) <= TOL
    assert not ranks[0]["inside_after_exit"]


def test_kda_state_and_conv_halo_are_passed(ranks, reference):
    """Rank 1 started from a zero KDA state, or with zeros for the convs' previous inputs: its logits are far from
    one process's (the first rank has nothing to receive and is unchanged)."""
    ref = reference["logits"][:, 19:]
    for part in ("state", "halo"):
        assert torch.equal(ranks[0][f"without_{part}"], ranks[0]["prefill"])
        assert _rel(ranks[1][f"without_{part}"], ref) > 1000 * TOL, part


def test_unsupported_arguments_are_refused_on_every_rank(ranks):
    """Padding (in rank 1's piece only: rank 0 is refused too, not left waiting), a cache, unshifted labels."""
    for r in ranks:
        mask, cache, labels = r["errors"]
        assert mask.startswith("attention_mask: not supported under context parallel (padding")
        assert cache.startswith("use_cache: not supported under context parallel")
        assert labels.startswith("labels: not supported under context parallel")


def test_context_parallel_needs_a_process_group():
    from transformers_kimi3.context_parallel import context_parallel

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ValueError, match="initialised process group"):
        with context_parallel(_model()):
            pass
