"""Which cuBLAS kernel each projection of a decode step gets, and how close it comes to the memory bandwidth.

The decode profile of the 4.3B benchmark config (bench/results/e2e_h200.json, profile rows at 774bcb3) showed 14
calls per step of `nvjet_sm90_tst_8x64_64x16_2x1_v_bz_TNN` at ~13.7 us each, several times slower per byte than
the `64x8 ... TNT` kernels of the other projections. This script records every nn.Linear call of one decode step
of that model (B=1, input shape and strides), then times each distinct case alone, CUDA-graph-replayed, with the
kernel names the profiler sees: as called, with a contiguous 2-D input, as torch.mv (one token), with the weight as
left operand, and two narrow projections concatenated. Finding (run of aa5a787, results/decode_gemms_h200.jsonl,
and the mlp rows of results/moe_decode_h200.json): the slow calls were the shared expert's 2304 -> 1024 gate/up
projections; one token through that MLP took 30 us in cuBLAS and 16 us as `moe_decode.mlp_gemv`, which the model
now uses.

    PYTHONPATH=$PWD/src:$PWD/kernels python bench/decode_gemms.py --out DIR     # one H200, ~1 min
"""
import argparse
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "kernels"), str(ROOT / "bench")]

from _timing import graph_us, write_jsonl  # noqa: E402  (back-to-back replays: the GPU time of a short call)


def kernels_of(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:70] for e in prof.events() if e.device_type.name == "CUDA"})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from transformers_kimi3.benchmark import BENCH_CONFIG, build_pair
    from transformers_kimi3.cache import Kimi3Cache

    # the model bench/e2e.py decodes: ours loaded from the native model's folder (7 KDA + 1 MLA, one shared expert)
    native, model = build_pair(BENCH_CONFIG, torch.device("cuda"), torch.bfloat16)
    del native
    torch.cuda.empty_cache()
    seen = OrderedDict()  # (in, out, input shape, input strides) -> module names

    def hook(name):
        def fn(mod, inputs):
            x = inputs[0]
            seen.setdefault((mod.in_features, mod.out_features, tuple(x.shape), tuple(x.stride())), []).append(name)
        return fn

    ids = torch.randint(3, model.config.vocab_size, (1, 64), device="cuda")
    with torch.no_grad():
        cache = Kimi3Cache(model.config)
        tok = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear)]
        model(input_ids=tok, past_key_values=cache)
        for h in handles:
            h.remove()
        rows = []
        for (fin, fout, shape, stride), names in seen.items():
            w = model.get_submodule(names[0]).weight
            if shape[-1] != fin:  # a module that reads its weight itself (MLA's absorbed kv_b_proj): not a GEMM here
                continue
            x = torch.empty_strided(shape, stride, device="cuda", dtype=w.dtype).normal_()
            x2 = x.reshape(-1, fin).contiguous()
            us, us2 = graph_us(lambda: F.linear(x, w)), graph_us(lambda: F.linear(x2, w))
            row = dict(modules=sorted({n.split(".", 3)[-1] for n in names}), calls_per_step=len(names),
                       in_features=fin, out_features=fout, input_shape=shape, input_stride=stride,
                       us=round(us, 2), TBps=round(w.numel() * 2 / us / 1e6, 2), kernels=kernels_of(lambda: F.linear(x, w)),
                       us_2d_contiguous=round(us2, 2), kernels_2d_contiguous=kernels_of(lambda: F.linear(x2, w)))
            if x2.shape[0] == 1:  # one token: cuBLAS GEMV, which splits the rows over many blocks
                row["us_mv"] = round(graph_us(lambda: torch.mv(w, x2[0])), 2)
                row["kernels_mv"] = kernels_of(lambda: torch.mv(w, x2[0]))
            # the weight as the left operand: cuBLAS sees the transposed problem and may tile it differently
            row["us_weight_left"] = round(graph_us(lambda: (w @ x2.t()).t()), 2)
            row["kernels_weight_left"] = kernels_of(lambda: (w @ x2.t()).t())
            if fout <= 256:  # two narrow projections of the same input (f_a and g_a) as one GEMM
                wcat = torch.cat([w, w])
                row["us_two_concatenated"] = round(graph_us(lambda: F.linear(x2, wcat)), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_jsonl(args.out, "decode_gemms.jsonl", rows)


if __name__ == "__main__":
    main()
