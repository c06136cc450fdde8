"""`plan_device_map` (placement.py): byte counts equal a loaded model's tensors exactly, the map keeps decoder layers
whole within each GPU's budget and loads with `from_pretrained`, the full K3 on 8 x H200 needs its experts partly in
host memory and on 16 x H200 does not, and bad arguments are refused by name."""

import os
import time

import pytest
import torch

from kimi3_testing import ROOT, rel_err, tiny_k3_text_config
from transformers_kimi3 import Kimi3ForCausalLM, Kimi3ForConditionalGeneration
from transformers_kimi3 import __main__ as cli
from transformers_kimi3.placement import (
    RELEASED_MXFP4,
    meta_model,
    plan_device_map,
    released_k3_config,
    tensor_bytes,
)

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")  # MXFP4 experts and a vision tower
H200 = "140GiB"
K3_EXPERT_LAYER = 896 * 3 * 3584 * 3072 * 17 // 32  # one MoE layer's packed routed experts: 4.25 bits per weight


def _owner(device_map, name):
    """The device of tensor `name`: its longest module prefix in the map."""
    keys = [k for k in device_map if name == k or name.startswith(k + ".")]
    assert keys, name
    return device_map[max(keys, key=len)]


def _check_plan(plan, model, sizes):
    """Every tensor has one device; per-device bytes add up; GPUs within budget; layers whole (or whole but for their
    offloaded experts) and in order over the GPUs."""
    placed = {}
    for name, b in sizes.items():
        d = _owner(plan.device_map, name)
        placed[d] = placed.get(d, 0) + b
    assert placed == {d: b for d, b in plan.device_bytes.items() if b}
    assert sum(placed.values()) == plan.total_bytes == sum(sizes.values())
    for g in range(plan.gpus):
        used = plan.device_bytes.get(g, 0) + (plan.staging_bytes if g == 0 else 0)
        assert used <= plan.weight_budget, (g, used)
    order = []
    layer_names = {n for n, m in model.named_modules() if type(m).__name__ == "Kimi3DecoderLayer"}
    for layer in sorted(layer_names, key=lambda n: int(n.rsplit(".", 1)[1])):
        devices = {_owner(plan.device_map, n) for n in sizes if n.startswith(layer + ".")}
        gpu = devices - {"cpu"}
        assert len(gpu) == 1, (layer, devices)
        if "cpu" in devices:  # only the routed experts of an offloaded layer
            cpu = {n for n in sizes if n.startswith(layer + ".") and _owner(plan.device_map, n) == "cpu"}
            assert cpu and all(".block_sparse_moe.experts." in n for n in cpu), cpu
            assert int(layer.rsplit(".", 1)[1]) in plan.offloaded_layers
        order.append(gpu.pop())
    assert order == sorted(order)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_equal_the_loaded_models_tensors(dtype):
    """Sizes from the meta model equal every tensor of the model loaded for real (bf16: the fp32 modules stay fp32,
    the experts stay uint8)."""
    real = Kimi3ForConditionalGeneration.from_pretrained(TINY, dtype=dtype)
    got = tensor_bytes(meta_model(TINY), dtype)
    want = {n: t.nbytes for n, t in list(real.named_parameters()) + list(real.named_buffers())}
    assert got == want
    assert sum(t.nbytes for t in real.state_dict().values()) == sum(got.values())
    assert any(t.dtype == torch.uint8 for t in real.buffers())
    if dtype == torch.bfloat16:
        assert any(t.dtype == torch.float32 for t in real.parameters())


def test_bytes_of_a_text_model_built_on_the_cpu():
    config = tiny_k3_text_config(quantization_config=RELEASED_MXFP4)
    real = Kimi3ForCausalLM(config)
    assert tensor_bytes(meta_model(config), torch.float32) == {n: t.nbytes for n, t in real.state_dict().items()}


@pytest.mark.parametrize("offload", [False, True])
def test_map_keeps_layers_whole_within_budget(offload):
    model = meta_model(TINY)
    sizes = tensor_bytes(model)
    total = sum(sizes.values())
    gpu_memory = total // 3 if not offload else total * 28 // 100  # the latter: 3 layers' experts on the host
    kw = dict(gpus=4, gpu_memory=gpu_memory, reserve=0.0)
    if offload:
        with pytest.raises(ValueError, match="offload_experts=True"):
            plan_device_map(TINY, **kw)
        kw["offload_experts"] = True
    plan = plan_device_map(TINY, **kw)
    _check_plan(plan, model, sizes)
    assert bool(plan.offloaded_layers) == offload and ("offload_buffers" in plan.from_pretrained_kwargs()) == offload
    assert set(plan.device_map.values()) <= set(range(4)) | {"cpu"}
    text = str(plan)
    assert "cuda:3" in text and ("routed experts of" in text) == offload


def test_float_experts_offload_too():
    config = tiny_k3_text_config()  # no quantization config: float Kimi3Experts (parameters)
    model = meta_model(config)
    sizes = tensor_bytes(model)
    plan = plan_device_map(config, gpus=2, gpu_memory=sum(sizes.values()) * 45 // 100, reserve=0.0,
                           offload_experts=True)
    assert plan.offloaded_layers
    _check_plan(plan, model, sizes)


def test_map_loads_with_from_pretrained(tmp_path):
    """The plan's keys are what `from_pretrained(device_map=...)` accepts: with the GPUs replaced by the CPU and the
    host by disk (this machine has no GPU), the offloaded experts load as offloaded buffers and the logits equal the
    plain model's."""
    model = meta_model(TINY)
    total = sum(tensor_bytes(model).values())
    plan = plan_device_map(TINY, gpus=4, gpu_memory=total * 28 // 100, reserve=0.0, offload_experts=True)
    kw = plan.from_pretrained_kwargs()
    kw["device_map"] = {k: "disk" if v == "cpu" else "cpu" for k, v in kw["device_map"].items()}
    loaded = Kimi3ForConditionalGeneration.from_pretrained(TINY, offload_folder=str(tmp_path), **kw).eval()
    assert "disk" in loaded.hf_device_map.values()
    plain = Kimi3ForConditionalGeneration.from_pretrained(TINY).eval()
    ids = torch.randint(3, 90, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, plain(input_ids=ids).logits) < 1e-5


def test_full_k3_on_8_and_16_h200():
    """The released K3 (1.56 TB of weights) exceeds 8 x H200 with the default reserve, so some layers' routed
    experts go to host memory; 16 x H200 hold everything. Planned on the meta device in seconds."""
    start = time.perf_counter()
    model = meta_model(released_k3_config())
    sizes = tensor_bytes(model)
    assert sum(sizes.values()) == 1_560_860_316_032  # the model card's "1.56 TB": 1,446.5 GB experts + 114.4 GB rest
    with pytest.raises(ValueError, match="offload_experts=True"):
        plan_device_map(gpus=8, gpu_memory=H200)
    eight = plan_device_map(gpus=8, gpu_memory=H200, offload_experts=True)
    sixteen = plan_device_map(gpus=16, gpu_memory=H200)
    assert time.perf_counter() - start < 10
    _check_plan(eight, model, sizes)
    _check_plan(sixteen, model, sizes)
    assert eight.staging_bytes == K3_EXPERT_LAYER
    assert eight.host_bytes == len(eight.offloaded_layers) * K3_EXPERT_LAYER
    # the fewest layers: one fewer would leave more than the GPUs' budget on them
    gpu_room = 8 * eight.weight_budget - eight.staging_bytes
    assert eight.total_bytes - eight.host_bytes <= gpu_room < eight.total_bytes - eight.host_bytes + K3_EXPERT_LAYER
    assert len(eight.offloaded_layers) == 32
    assert not sixteen.offloaded_layers and sixteen.host_bytes == 0
    assert max(sixteen.device_bytes.values()) < sixteen.weight_budget
    assert len({g for g in sixteen.device_map.values()}) == 16
    with pytest.raises(ValueError, match="host_memory"):
        plan_device_map(gpus=8, gpu_memory=H200, offload_experts=True, host_memory="400GiB")


def test_bad_arguments_are_named(tmp_path):
    for kw, name in [(dict(gpus=0), "gpus"), (dict(gpus="8"), "gpus"), (dict(gpu_memory="lots"), "gpu_memory"),
                     (dict(gpu_memory=-1), "gpu_memory"), (dict(reserve=1.5), "reserve"),
                     (dict(reserve="200GiB"), "reserve"), (dict(host_memory="1XB"), "host_memory"),
                     (dict(offload_experts="yes"), "offload_experts"), (dict(dtype=torch.int8), "dtype")]:
        with pytest.raises(ValueError, match=name):
            plan_device_map(TINY, **kw)
    with pytest.raises(ValueError, match="config_or_folder"):
        plan_device_map(str(tmp_path))
    with pytest.raises(ValueError, match="config_or_folder"):
        plan_device_map(42)


def test_cli_plan_prints_the_table(capsys):
    cli.main(["plan", "--model", TINY, "--gpus", "2", "--gpu-memory", "1GiB", "--reserve", "0.2"])
    out = capsys.readouterr().out
    assert "cuda:1" in out and "204.8 MiB each kept" in out and "2.8 MiB of weights" in out
    with pytest.raises(SystemExit, match="gpus"):
        cli.main(["plan", "--model", TINY, "--gpus", "0"])
