"""bench/released.py at toy widths on the CPU (`--tiny`), each stage into a results file, and the values that can be
wrong: ours on native's tensors gives native's logits and tokens, an out-of-memory is a row and the run goes on, the
goals and the 93-layer projection recompute from the rows' own fields, the offloaded shares are 25 / 50 / 90 % of
the experts and offloading leaves tokens and logits as they were with every expert on the device. The H200 run of
the same script at the released sizes is what docs/performance.md ("Released sizes") describes."""

import importlib.util
import json
import math
import os

import pytest
import torch

from kimi3_testing import ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_released", os.path.join(ROOT, "bench", "released.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(bench, tmp_path, *argv):
    out = tmp_path / "released.json"
    bench.main(["--tiny", "--out", str(out), *argv])
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1 and runs[0]["meta"]["tiny"] and runs[0]["meta"]["device"] == "cpu"
    rows = runs[0]["rows"]
    assert rows[-1]["stage"] == "run" and not any("error" in r for r in rows), rows
    return rows


def pick(rows, **key):
    return [r for r in rows if all(r.get(k) == v for k, v in key.items())]


def one(rows, **key):
    found = pick(rows, **key)
    assert len(found) == 1, (key, found)
    return found[0]


def close(a, b, tol=1e-9):
    return math.isclose(a, b, rel_tol=tol, abs_tol=1e-12)


def test_kimi_linear_ours_on_natives_tensors_and_an_out_of_memory_recorded(bench, tmp_path, monkeypatch):
    real = bench.prefill_once

    def native_out_of_memory_at_512(model, ids, chunk=None):
        if type(model).__name__.startswith("KimiLinear") and ids.shape[1] == 512:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(model, ids, chunk)

    monkeypatch.setattr(bench, "prefill_once", native_out_of_memory_at_512)
    rows = run(bench, tmp_path, "--stages", "kimi_linear")

    native, ours = one(rows, part="build", impl="native"), one(rows, part="build", impl="ours")
    assert ours["from_native_tensors"] and ours["weight_gib"] == native["weight_gib"] > 0
    check = one(rows, part="check", impl="ours")
    assert check["logits_rel_err_vs_native"] < 1e-5 and check["argmax_agree"] == 1.0
    for impl in ("native", "ours"):
        for T in (64, 128):
            r = one(rows, part="prefill", impl=impl, T=T)
            assert r["ms"] > 0 and close(r["tok_s"], T / r["ms"] * 1e3)
        for B in (1, 2):
            r = one(rows, part="decode", impl=impl, batch=B)
            assert r["prompt"] == 32 and close(r["tok_s"], B / r["ms_per_step"] * 1e3)
            if impl == "ours":  # fp32, the same weights: the same greedy tokens
                assert r["tokens_equal_native"] == 1.0

    # the simulated out-of-memory at 512 tokens is a row, native's search stops there and ours' still runs
    assert one(rows, part="longest", impl="native", T=512)["oom"] is True
    assert [r["T"] for r in pick(rows, part="longest", impl="native") if "s" in r] == [128, 256]
    fit = one(rows, part="longest_fit", impl="native")
    assert (fit["longest_T"], fit["first_failed_T"], fit["failed_because"]) == (256, 512, "out of memory")
    fit = one(rows, part="longest_fit", impl="ours")
    assert fit["longest_T"] == 512 and fit["chunk"] == 64 and fit["first_failed_T"] is None

    goals = one(rows, part="goals")
    tok_s = (lambda part, impl, **k: one(rows, part=part, impl=impl, **k)["tok_s"])
    assert close(goals["decode_ratio"], tok_s("decode", "ours", batch=1) / tok_s("decode", "native", batch=1))
    assert close(goals["prefill_ratio"], tok_s("prefill", "ours", T=64) / tok_s("prefill", "native", T=64))
    assert goals["decode_met"] == (goals["decode_ratio"] >= 8)
    assert goals["prefill_met"] == (goals["prefill_ratio"] >= 1.5)
    assert goals["longest_goal_T"] == 512 and goals["longest_met"] is True


def test_k3_slice_layers_and_the_projections_arithmetic(bench, tmp_path):
    rows = run(bench, tmp_path, "--stages", "k3_slice")
    build = one(rows, part="build", stage="k3_slice")
    assert build["layers"] == 4 and build["kinds"] == ["dense", "kda_moe", "kda_moe", "mla_moe"]
    layers = pick(rows, part="layer")
    assert [r["layer"] for r in layers] == [0, 1, 2, 3]
    for r in layers:
        for t in [r["prefill"]] + [r["decode"][b] for b in ("1", "2")]:
            assert t["ms"] > 0 and t["attn_ms"] > 0 and t["ffn_ms"] > 0
            assert (t["routed_ms"] > 0) == (r["kind"] != "dense")

    p = one(rows, part="projection")
    counts = p["layer_counts"]
    assert counts == {"dense": 1, "kda_moe": 68, "mla_moe": 24} and p["layers"] == 93 and p["gpus"] == 16
    assert 1.5e12 < p["weight_bytes"] < 1.6e12 and 0.9 < p["expert_bytes"] / p["weight_bytes"] < 0.95

    totals = {"prefill": one(rows, part="prefill", stage="k3_slice")["ms"]}
    for B in (1, 2):
        totals[f"decode_b{B}"] = one(rows, part="decode", stage="k3_slice", batch=B)["graph_step_ms"]
    for regime, x in p["inputs"].items():  # each kind's mean over the slice's layers; other = slice - its layers
        times = [r["prefill"] if regime == "prefill" else r["decode"][regime[len("decode_b"):]] for r in layers]
        for kind in counts:
            ts = [t["ms"] for r, t in zip(layers, times) if r["kind"] == kind]
            assert close(x["layer_ms"][kind], sum(ts) / len(ts))
        assert close(x["slice_ms"], totals[regime]) and close(x["slice_layers_ms"], sum(t["ms"] for t in times))
        assert close(x["other_ms"], max(totals[regime] - x["slice_layers_ms"], 0.0))

    pipe = p["pipeline"]
    assert sum(pipe["layers_per_gpu"]) == 93 and len(pipe["layers_per_gpu"]) == 16
    assert {k: sum(g[k] for g in pipe["kinds_per_gpu"]) for k in counts} == counts
    for regime, r in pipe["regimes"].items():
        x = p["inputs"][regime]
        stage = [sum(n * x["layer_ms"][k] for k, n in g.items()) for g in pipe["kinds_per_gpu"]]
        stage[-1] += x["other_ms"]
        assert all(close(a, b) for a, b in zip(r["stage_ms"], stage))
        for g, hop in enumerate(r["hop_ms"]):
            gbs = p["ib_gbs"] if (g + 1) % p["gpus_per_node"] == 0 else p["nvlink_gbs"]
            assert close(hop, p["latency_us"] / 1e3 + x["tokens"] * p["hidden"] * 2 / (gbs * 1e9) * 1e3)
        assert close(r["sequential_ms"], sum(stage) + sum(r["hop_ms"]))
        assert close(r["tok_s_sequential"], x["tokens"] * 1e3 / r["sequential_ms"])

    ep = p["expert_parallel"]
    for t in ep["tried"]:
        per_gpu = (p["weight_bytes"] - p["expert_bytes"]) / t["stages"] + p["expert_bytes"] / 16
        assert close(t["per_gpu_bytes"], per_gpu) and t["fits"] == (per_gpu <= ep["budget_bytes"])
    assert [t["fits"] for t in ep["tried"]] == [False] * (len(ep["tried"]) - 1) + [True]
    g = ep["group"]
    assert ep["stages"] * g == 16 and ep["stages"] == ep["tried"][-1]["stages"]
    assert close(ep["a2a_bytes_per_token_per_moe_layer"], 2 * 16 * 3584 * 2 * (g - 1) / g)
    assert ep["link_gbs"] == (p["nvlink_gbs"] if g <= p["gpus_per_node"] else p["ib_gbs"])
    assert {k: sum(s[k] for s in ep["kinds_per_stage"]) for k in counts} == counts
    for regime, r in ep["regimes"].items():
        x = p["inputs"][regime]
        a2a = 2 * p["latency_us"] / 1e3 + ep["a2a_bytes_per_token_per_moe_layer"] * x["tokens"] / (
            ep["link_gbs"] * 1e9) * 1e3
        assert close(r["a2a_ms_per_moe_layer"], a2a)
        stage = [sum(n * (x["layer_ms"][k] + (a2a if k != "dense" else 0)) for k, n in s.items())
                 for s in ep["kinds_per_stage"]]
        stage[-1] += x["other_ms"]
        assert all(close(a, b) for a, b in zip(r["stage_ms"], stage))
        assert close(r["tok_s_sequential"], g * x["tokens"] * 1e3 / (sum(stage) + sum(r["hop_ms"])))


def test_offload_shares_and_unchanged_tokens(bench, tmp_path):
    rows = run(bench, tmp_path, "--stages", "offload")
    E = one(rows, part="build", stage="offload")["experts"]
    base = one(rows, config="all_on_device_eager")
    assert base["resident_experts"] == E and base["tok_s"] > 0
    misses = []
    for target, resident in ((0.25, 15), (0.5, 10), (0.9, 2)):
        r = one(rows, config=f"host_{round(target * 100)}%")
        assert r["resident_experts"] == resident and r["experts_on_host_only"] == E - resident
        assert close(r["host_fraction"], (E - resident) / E) and abs(r["host_fraction"] - target) <= 1 / E
        assert r["tokens_equal_all_on_device"] == 1.0 and "first_difference_vs_all_on_device" not in r
        assert r["forced_logits_equal_all_on_device"] is True and r["forced_logits_rel_err"] == 0.0
        assert 1 <= r["resident_after_min"] <= resident and r["tok_s"] > 0 and r["forced_tok_s"] > 0
        misses.append(r["forced_misses_per_layer_step"])
    assert 0 < misses[0] < misses[-1]  # more experts on the host, more copies per step


def test_deadline_skips_and_says_so(bench, tmp_path):
    rows = run(bench, tmp_path, "--deadline-minutes", "0")
    assert [r["stage"] for r in rows] == ["kimi_linear", "k3_slice", "offload", "run"]
    assert all(r["skipped"] == "deadline" for r in rows[:3]) and rows[-1]["stopped_by_deadline"] is True
