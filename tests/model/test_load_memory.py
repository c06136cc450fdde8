"""`from_pretrained` of a many-shard MXFP4 folder streams (`checkpoint.read_tensors`): in a fresh interpreter the
load's peak resident memory above the interpreter's is at most the model plus 1.2 x the largest shard, what stays
resident is the model, and the model holds the folder's tensors. The builder and measurement of bench/released.py's
memory stage at its toy widths with many experts, so that the packed experts are most of the bytes, as in the release
(docs/performance.md has the K3 slice's numbers)."""

import importlib.util
import os
import re

import torch
from safetensors import safe_open

from kimi3_testing import ROOT
from transformers_kimi3 import Kimi3ForCausalLM

# the interpreter's own allocations during the load (the meta model, Transformers' bookkeeping): about 10 MB here
ALLOWANCE = 32 * 2**20
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight_(packed|scale)$")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_released", os.path.join(ROOT, "bench", "released.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_many_shard_mxfp4_folder_loads_within_the_model_plus_a_shard(tmp_path):
    bench = _bench()
    config = bench.slice_config(layers=4, tiny=True, experts=512, toy=bench.TINY_K3)
    built = bench.build_folder(config, str(tmp_path), shard_bytes=50 * 10**6)
    largest = max(built["shard_bytes"])
    assert len(built["shard_bytes"]) >= 3 and largest <= 50 * 10**6

    row = bench.measure_in_subprocess(str(tmp_path))
    assert row["bytes_by_dtype"]["uint8"] > 0.9 * row["model_bytes"]  # mostly packed experts, as in the release
    verdict = bench.verdict(row, largest, ALLOWANCE)
    assert verdict["within_goal"], (verdict, row)
    # the file pages are not kept beside the copies: what stays resident is the model
    assert row["after_load"]["VmRSS"] - row["baseline_rss"] <= row["model_bytes"] + ALLOWANCE, row

    model = Kimi3ForCausalLM.from_pretrained(tmp_path)
    state = model.state_dict()
    heads = config.kda_num_heads
    for file in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                m = EXPERT.match(name)
                if m:
                    loaded = state[f"{m.group(1)}.{m.group(3)}_{m.group(4)}"][int(m.group(2))]
                elif name.endswith("A_log"):  # stored padded to the head dim
                    t, loaded = t[:heads], state[name]
                else:
                    loaded = state[name]
                assert loaded.dtype == t.dtype and torch.equal(loaded, t), name
