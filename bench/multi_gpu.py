"""Several GPUs of one host: `device_map` across two GPUs and the tensor / expert parallel plans under `torchrun`,
each against the same model on one GPU (greedy tokens of two `generate()` calls sharing a cache, logits of a
left-padded batch).

    python bench/multi_gpu.py all --out OUT                           # two GPUs: ~2 min
    python bench/multi_gpu.py all --tiny --device cpu --out OUT       # two CPU processes (gloo): the CI smoke test

`all` builds a random K3-layout model (KDA + gated MLA + AttnRes + latent MoE with shared experts, seeded), saves it
in the official layout, and runs, each stage recorded even when it fails:
  1. reference: one GPU (`device_map={"": 0}`), bf16 and fp32;
  2. device_map: the layers split over cuda:0 / cuda:1 as `from_pretrained(device_map=...)` places them (the
     kernels launch on each layer's device);
  3. tp: `torchrun --nproc_per_node 2 ... tp --plan tp`: Kimi3TextConfig.base_model_tp_plan with `tp_plan="auto"`
     (routed experts split along their intermediate width, shared experts and dense MLP colwise / rowwise, attention
     replicated);
  4. ep: `--plan ep`: Kimi3TextConfig.base_model_ep_plan (whole experts per rank).
Results go to OUT/multi_gpu.json; the two-GPU run is kept as bench/results/multi_gpu_h200.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _timing import label  # noqa: E402
for _p in (ROOT / "src", ROOT / "kernels"):  # after PYTHONPATH, so that another checkout can be pointed at
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

T0 = time.time()



def new_ep_api():
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return "ep_size" in getattr(DistributedConfig, "__dataclass_fields__", {})


MODEL = dict(  # K3 layout at a size that builds in seconds: 6 layers, KDA 8x128, MLA 8 heads, 32 experts top-4
    vocab_size=8192, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, num_experts=32, num_experts_per_token=4, num_shared_experts=1, routed_expert_hidden_size=512,
    attn_res_block_size=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    linear_attn_config=dict(num_heads=8, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                            use_full_rank_gate=True, kda_layers=[1, 2, 4, 5], full_attn_layers=[3, 6]),
)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=2,
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
            num_experts_per_token=2, routed_expert_hidden_size=32,
            linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                    use_full_rank_gate=True, kda_layers=[1, 2, 4, 5], full_attn_layers=[3, 6]))
NEW_TOKENS = 8  # per generate() call; two calls share one cache


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max())


def inputs(vocab):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 96), (2, 40), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :8], mask[1, :8] = 0, 0  # left padding
    return ids, mask


def build(folder):
    from transformers_kimi3 import Kimi3ForCausalLM, Kimi3TextConfig

    torch.manual_seed(0)
    model = Kimi3ForCausalLM(Kimi3TextConfig.k3(**MODEL))
    with torch.no_grad():  # make every mechanism matter: non-uniform AttnRes mixing, a non-zero correction bias
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.5)
        for layer in model.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                moe.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def run_model(model, device):
    ids, mask = inputs(model.config.vocab_size)
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float().cpu()
    kw = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
              max_new_tokens=NEW_TOKENS)
    first = model.generate(ids, attention_mask=mask, **kw)
    mask2 = torch.cat([mask, mask.new_ones(2, first.sequences.shape[1] - ids.shape[1])], 1)
    second = model.generate(first.sequences, attention_mask=mask2, past_key_values=first.past_key_values, **kw)
    steps = torch.stack(first.logits + second.logits, 1).float().cpu()
    return {"logits": logits, "tokens": second.sequences[:, ids.shape[1]:].cpu(), "step_logits": steps}


def compare(got, ref):
    tokens_equal = bool(torch.equal(got["tokens"], ref["tokens"]))
    out = {"tokens_equal": tokens_equal, "logits_rel_err": rel(got["logits"], ref["logits"]),
           "step_logits_rel_err": rel(got["step_logits"], ref["step_logits"])}
    if not tokens_equal:
        diff = (got["tokens"] != ref["tokens"]).nonzero()
        out["first_token_mismatch"] = diff[0].tolist()
    return out


# ----------------------------------------------------------------------------- stages in one process
def stage_single(folder, device, dtypes, results, work):
    from transformers_kimi3 import Kimi3ForCausalLM, kernel_status

    results["kernel_status"] = json.loads(json.dumps(kernel_status(device if device != "cpu" else "cpu"),
                                                     default=str))
    refs = {}
    for dtype in dtypes:
        t = time.time()
        dm = {"": 0} if device == "cuda" else None
        model = Kimi3ForCausalLM.from_pretrained(folder, dtype=dtype, device_map=dm).eval()
        dev = next(model.parameters()).device
        refs[str(dtype)] = run_model(model, dev)
        results["reference"][str(dtype)] = {"device": str(dev), "seconds": round(time.time() - t, 1)}
        del model
    torch.save(refs, work / "ref.pt")
    if len(refs) > 1:  # the precision floor: how far bf16 is from fp32 on this model, same device, same code
        (a, ra), (b, rb) = list(refs.items())[:2]
        results["reference"][f"{a}_vs_{b}"] = {"logits_rel_err": rel(ra["logits"], rb["logits"]),
                                              "tokens_equal": bool(torch.equal(ra["tokens"], rb["tokens"]))}
    log("reference done")
    return refs


def device_map_two_gpus():
    L = MODEL["num_hidden_layers"]
    return {"model.embed_tokens": 0, **{f"model.layers.{i}": 0 if i < L // 2 else 1 for i in range(L)},
            "model.norm": 1, "model.output_attn_res_proj": 1, "model.output_attn_res_norm": 1, "lm_head": 1}


def stage_device_map(folder, dtypes, refs):
    """The model split over two GPUs as from_pretrained places it; {dtype: result}."""
    from transformers_kimi3 import Kimi3ForCausalLM

    out = {}
    for dtype in dtypes:
        t = time.time()
        try:
            model = Kimi3ForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map_two_gpus()).eval()
            placed = sorted({str(p.device) for p in model.parameters()})
            got = run_model(model, torch.device("cuda:0"))
            out[str(dtype)] = {"devices": placed, **compare(got, refs[str(dtype)]),
                               "seconds": round(time.time() - t, 1)}
            del model
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - record and go on
            out[str(dtype)] = {"error": f"{type(e).__name__}: {str(e)[:600]}",
                               "where": traceback.format_exc()[-1500:]}
        log("device_map", dtype, {k: v for k, v in out[str(dtype)].items() if k != "where"})
    return out


# ----------------------------------------------------------------------------- torchrun worker
def worker(args):
    import torch.distributed as dist

    from transformers_kimi3 import Kimi3ForCausalLM

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    from transformers.distributed import DistributedConfig

    # the plans are Kimi3TextConfig's own (base_model_tp_plan / base_model_ep_plan, chosen by Transformers version)
    if args.plan == "tp":
        dist_config = DistributedConfig(tp_plan="auto")
    elif new_ep_api():
        dist_config = DistributedConfig(tp_size=2, tp_plan="auto", ep_size=2, ep_implementation="all_reduce")
    else:
        dist_config = DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
    refs = torch.load(Path(args.work) / "ref.pt")
    out = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        t = time.time()
        try:
            model = Kimi3ForCausalLM.from_pretrained(args.folder, dtype=dtype, distributed_config=dist_config).eval()
            experts = model.model.layers[1].block_sparse_moe.experts
            seen = {}

            def probe(mod, args, _seen=seen):  # what the experts' forward sees (DTensor or local, strides)
                for name in ("w1", "w2"):
                    w = getattr(mod, name)
                    _seen[name] = dict(type=type(w).__name__, shape=list(w.shape), stride=list(w.stride()),
                                       contiguous=w.is_contiguous())
                _seen["x"] = dict(type=type(args[0]).__name__, shape=list(args[0].shape))
            experts.register_forward_pre_hook(probe)
            w1 = experts.w1
            local = w1.to_local() if hasattr(w1, "to_local") else w1
            got = run_model(model, device)
            out[f"torch.{dtype_name}"] = {"w1_local_shape": list(local.shape), "w1_global_shape": list(w1.shape),
                                          "experts_num_experts": experts.num_experts,
                                          **compare(got, refs[f"torch.{dtype_name}"]), "inside_forward": seen,
                                          "seconds": round(time.time() - t, 1)}
            del model
        except Exception as e:  # noqa: BLE001
            out[f"torch.{dtype_name}"] = {"error": f"{type(e).__name__}: {str(e)[:600]}",
                                          "where": traceback.format_exc()[-2000:]}
        log(f"rank {rank}", args.plan, dtype_name, {k: v for k, v in out[f"torch.{dtype_name}"].items()
                                                    if k != "where"})
    if rank == 0:
        json.dump(out, open(Path(args.work) / f"{args.plan}.json", "w"), indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(args, plan, results):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), __file__, "tp", "--plan", plan, "--folder", str(args.folder),
           "--work", str(args.work), "--device", args.device, "--dtypes", args.dtypes] + (["--tiny"] if args.tiny else [])
    results["commands"][plan] = " ".join(["torchrun", "--nproc_per_node", "2", "bench/multi_gpu.py", "tp",
                                           "--plan", plan, "--folder", "MODEL", "--work", "WORK", "--dtypes",
                                           args.dtypes])
    t = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(ROOT / "src"),
                                                       str(ROOT / "kernels")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.stage_timeout)
    (Path(args.out) / f"{plan}.log").write_text(proc.stdout[-200000:] + "\n--- stderr ---\n" + proc.stderr[-200000:])
    path = Path(args.work) / f"{plan}.json"
    results[plan] = json.load(open(path)) if path.exists() else {"error": f"torchrun exit {proc.returncode}",
                                                                    "stderr_tail": proc.stderr[-3000:]}
    results[plan]["wall_seconds"] = round(time.time() - t, 1)
    log(plan, "done", proc.returncode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["all", "tp"])
    ap.add_argument("--out", default="out_multi_gpu")
    ap.add_argument("--work", default="/tmp/kimi3_multi_gpu")
    ap.add_argument("--folder", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--plan", default="tp", choices=["tp", "ep"])
    ap.add_argument("--plans", default="tp,ep")
    ap.add_argument("--label", default=None, help="what ran, stored in the results (default: git describe)")
    ap.add_argument("--stage-timeout", type=int, default=150)
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    ap.add_argument("--skip-dm", action="store_true", help="only the 1-GPU reference and the torchrun plans")
    args = ap.parse_args()
    if args.tiny:  # the torchrun workers get --tiny too: they build nothing but must agree on sizes
        MODEL.update(TINY)
    args.work = Path(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    args.folder = Path(args.folder) if args.folder else args.work / "model"
    if args.stage == "tp":
        return worker(args)

    import transformers

    from transformers_kimi3 import Kimi3TextConfig

    Path(args.out).mkdir(parents=True, exist_ok=True)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if args.device == "cuda" else []
    results = {"tree": label(args.label), "device": args.device, "gpus": gpus, "torch": torch.__version__,
               "transformers": transformers.__version__, "python": platform.python_version(),
               "model": MODEL, "new_tokens_per_generate_call": NEW_TOKENS,
               "tp_plan": Kimi3TextConfig.base_model_tp_plan, "ep_plan": Kimi3TextConfig.base_model_ep_plan,
               "commands": {"all": "python bench/multi_gpu.py all --out OUT"},
               "reference": {}, "device_map": {}}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    results["parameters"] = build(args.folder)
    log("built", results["parameters"], "parameters")
    try:
        refs = stage_single(args.folder, args.device, dtypes, results, args.work)
        if args.skip_dm:
            results["device_map"] = {"skipped": "--skip-dm"}
        elif args.device == "cuda" and torch.cuda.device_count() >= 2:
            results["device_map"]["map"] = device_map_two_gpus()
            results["device_map"]["as_loaded"] = stage_device_map(args.folder, dtypes, refs)
        else:
            results["device_map"] = {"skipped": "needs two GPUs"}
    except Exception as e:  # noqa: BLE001
        results["error"] = f"{type(e).__name__}: {e}"
        results["where"] = traceback.format_exc()[-3000:]
    json.dump(results, open(Path(args.out) / "multi_gpu.json", "w"), indent=1, default=str)
    if "error" not in results:
        for plan in [p for p in args.plans.split(",") if p]:
            try:
                torchrun(args, plan, results)
            except Exception as e:  # noqa: BLE001
                results[plan] = {"error": f"{type(e).__name__}: {e}"}
            json.dump(results, open(Path(args.out) / "multi_gpu.json", "w"), indent=1, default=str)
    results["total_seconds"] = round(time.time() - T0, 1)
    json.dump(results, open(Path(args.out) / "multi_gpu.json", "w"), indent=1, default=str)
    summary = {k: results.get(k) for k in ("device_map", "tp", "ep")}
    print(json.dumps(summary, indent=1, default=str)[-6000:])


if __name__ == "__main__":
    main()
