"""`from_pretrained(folder, device_map=..., max_memory=..., offload_folder=...)` with layers on the CPU and on disk
(Accelerate's offload hooks): a forward pass and `generate()` with a cache reused across calls equal the plain model."""

import os

import pytest
import torch

from kimi3_testing import rel_err, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM

# Same weights and the same math: only the order of fp32 operations may differ (observed max rel 3e-7).
TOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3") / "model"
    tiny_model().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def plain(folder):
    return Kimi3ForCausalLM.from_pretrained(folder).eval()


def _offloaded(folder, offload_dir, device_map="auto", **kw):
    return Kimi3ForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=str(offload_dir), **kw).eval()


def _check_buffers(model, plain):
    """Offloaded layers keep their loaded e_score_correction_bias (an offloaded router weight must not make the module
    count as not loaded, which would re-initialise the bias to zero)."""
    for (name, b), (_, ref) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(b.cpu(), ref), name


def ids(B, T, seed):
    return torch.randint(3, 96, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("placement", ["auto", "explicit"])
def test_cpu_and_disk_offload_forward(folder, plain, tmp_path, placement):
    if placement == "auto":  # a small CPU budget: the first layers stay on the CPU, the rest go to disk
        model = _offloaded(folder, tmp_path / "off", max_memory={"cpu": "400KB"})
    else:  # explicit map: disk in the middle of the stack (an MLA layer and MoE layers), CPU around it
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                      "model.layers.2": "disk", "model.layers.3": "disk", "model.layers.4": "cpu",
                      "model.layers.5": "disk", "model.layers.6": "cpu", "model.norm": "cpu",
                      "model.output_attn_res_proj": "disk", "model.output_attn_res_norm": "cpu", "lm_head": "cpu"}
        model = _offloaded(folder, tmp_path / "off", device_map=device_map)
    placed = set(model.hf_device_map.values())
    assert placed == {"cpu", "disk"}, model.hf_device_map
    from transformers_kimi3.decode_graphs import one_device
    assert not one_device(model) and one_device(plain)  # a spread model never records a CUDA graph
    assert os.listdir(tmp_path / "off")  # offloaded weights are on disk
    _check_buffers(model, plain)

    x = ids(2, 19, seed=0)
    mask = torch.ones_like(x)
    mask[1, :4] = 0  # left padding: KDA unpads, MLA masks
    with torch.no_grad():
        got = model(input_ids=x, attention_mask=mask).logits
        ref = plain(input_ids=x, attention_mask=mask).logits
    assert rel_err(got, ref) < TOL


def test_offloaded_generate_with_cache_reused_across_calls(folder, plain, tmp_path):
    model = _offloaded(folder, tmp_path / "off", max_memory={"cpu": "400KB"})
    assert "disk" in model.hf_device_map.values()
    _check_buffers(model, plain)
    x = ids(1, 9, seed=1)
    runs = []
    for m in (model, plain):
        kw = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        with torch.no_grad():
            first = m.generate(x, max_new_tokens=5, **kw)
            # second call continues from the first call's cache (KDA states, conv windows, MLA latents)
            second = m.generate(first.sequences, past_key_values=first.past_key_values, max_new_tokens=5, **kw)
        assert second.past_key_values is first.past_key_values
        runs.append((second.sequences, torch.stack(first.logits + second.logits, 1)))
    (seq, logits), (seq_ref, logits_ref) = runs
    assert torch.equal(seq, seq_ref)
    assert rel_err(logits, logits_ref) < TOL
    # and both equal a fresh forward over the whole sequence without a cache
    with torch.no_grad():
        full = plain(input_ids=seq[:, :-1]).logits[:, x.shape[1] - 1:]
    assert rel_err(logits, full) < 5e-5  # chunked vs recurrent KDA (tests/test_cache_generation.py's tolerance)


def test_tensor_and_expert_parallel_plans_on_cpu(tmp_path):
    """bench/multi_gpu.py's TP plan (MLPs, shared and routed experts) and EP plan (whole experts per rank, with
    Kimi3Experts skipping the off-rank sentinel), as Kimi3TextConfig defines them, under torchrun with two CPU
    processes (gloo): the same fp32 logits and greedy tokens as one process. The two-H200 run is in
    bench/results/multi_gpu_h200.json."""
    import json
    import subprocess
    import sys

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(root, "src"), os.path.join(root, "kernels"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "multi_gpu.py"), "all", "--tiny", "--device",
                           "cpu", "--dtypes", "float32", "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work"), "--stage-timeout", "120"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(tmp_path / "out" / "multi_gpu.json"))
    for plan, local_w1 in (("tp", [8, 16, 32]), ("ep", [4, 32, 32])):  # tp: expert width split; ep: experts split
        r = res[plan]["torch.float32"]
        assert "error" not in r, r
        assert r["w1_local_shape"] == local_w1
        assert r["tokens_equal"] and r["logits_rel_err"] < 1e-5 and r["step_logits_rel_err"] < 1e-5, r
