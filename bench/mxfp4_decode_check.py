"""GPU self-check of the MXFP4 weight decodes of kimi3_kernels.mxfp4_gemm: inline-PTX ("ptx") vs fp32 bit
arithmetic ("portable"), bit for bit, then both timed in the grouped GEMM at K3 shapes.

    PYTHONPATH=$PWD/src:$PWD/kernels python bench/mxfp4_decode_check.py --out DIR [--tokens 1 64 1024 16384] [--split]
    python bench/mxfp4_decode_check.py --count        # no GPU needed: sm_90 SASS per weight, registers

1. Decode alone (a small kernel around the module's _dequant / _dequant_split): every byte value (both nibbles) x
   every scale 0..254 (one scale per row), and per-group scales, against an exact float64 reference (bf16 bits,
   signed zeros and the inf of 6 * 2^127 included).
2. Inside the GEMM: activations = identity, so C = the decoded weights (forward and transposed layouts, decode tile
   BM 16 and 128, interleaved and parity-split operands); random grouped GEMMs: ptx == portable bit for bit.
3. Timing (median of CUDA events, default tiles): gate+up (fused SiLU-GLU) and down at 896 experts, top-16, latent
   3584, width 3072, per decode. One JSON object per line on stdout and in DIR/mxfp4_decode_check.jsonl.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import moe  # noqa: E402  (bench/moe.py: module loading, routing, timing, K3 shapes)

T0 = time.time()
OUT = []


def emit(rec):
    rec["t_s"] = round(time.time() - T0, 1)
    OUT.append(rec)
    print(json.dumps(rec), flush=True)


def set_mode(decode, split=False):
    os.environ["KIMI3_MXFP4_DECODE"] = decode
    os.environ["KIMI3_MXFP4_SPLIT"] = "1" if split else "0"


def ref_decode(p, s):
    """Exact decode in float64, rounded to bf16 (exact except overflow to inf): [R, C/2], [R, C/32] -> [R, C]."""
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64,
                       device=p.device)
    codes = torch.stack((p & 15, p >> 4), -1).flatten(-2).long()
    sc = torch.exp2(s.double() - 127).repeat_interleave(32, -1)
    return (lut[codes] * sc).to(torch.bfloat16)


def same_bits(a, b):
    return bool(torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)))


def same_f32(a, b, bits=True):
    """Equal fp32 bits (bits=False: equal values, as a GEMM's sums lose the sign of a zero weight), any NaN equal to
    any NaN."""
    eq = (a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)) if bits else (a == b)
    return bool((eq | (torch.isnan(a) & torch.isnan(b))).all())


_DQ = _DQS = None  # the module's _dequant / _dequant_split, bound before the first launch of _decode


@triton.jit
def _decode(p_ptr, s_ptr, o_ptr, BR: tl.constexpr, C: tl.constexpr, PTX: tl.constexpr, SPLIT: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.load(p_ptr + r[:, None] * (C // 2) + tl.arange(0, C // 2)[None, :])
    s = tl.load(s_ptr + r[:, None] * (C // 32) + tl.arange(0, C // 32)[None, :])
    if SPLIT:
        lo, hi = _DQS(p, s, BR, C, PTX)
        o = o_ptr + r[:, None] * C + 2 * tl.arange(0, C // 2)[None, :]
        tl.store(o, lo)
        tl.store(o + 1, hi)
    else:
        tl.store(o_ptr + r[:, None] * C + tl.arange(0, C)[None, :], _DQ(p, s, BR, C, PTX))


def decode_kernel(G):
    global _DQ, _DQS
    _DQ, _DQS = G._dequant, G._dequant_split

    def run(p, s, ptx, split):
        R, C = p.shape[0], 2 * p.shape[1]
        out = torch.empty(R, C, dtype=torch.bfloat16, device=p.device)
        _decode[(R // 16,)](p, s, out, BR=16, C=C, PTX=ptx, SPLIT=split)
        return out

    return run


def check_decode(G, dev):
    run = decode_kernel(G)
    R, C = 256, 512
    lo = 0 if dev == "cuda" else 2  # the CPU interpreter flushes subnormal results (scale bytes 0, 1) to zero
    j = torch.arange(C // 2, device=dev)
    r = torch.arange(R, device=dev)
    p = ((j[None, :] + r[:, None]) % 256).to(torch.uint8)  # every byte value in every row
    scales = {"row_scale_0_254": (r.clamp(lo, 254)[:, None].expand(R, C // 32)),
              "group_scales": ((r[:, None] + 37 * torch.arange(C // 32, device=dev)[None, :]) % 255).clamp(lo)}
    ok = True
    for sname, s in scales.items():
        s = s.to(torch.uint8).contiguous()
        ref = ref_decode(p, s)
        for split in (False, True):
            outs = {ptx: run(p, s, ptx, split) for ptx in ((False, True) if dev == "cuda" else (False,))}
            rec = {"check": "decode", "scales": sname, "split": split,
                   "portable_eq_ref": same_bits(outs[False], ref)}
            if True in outs:
                rec["ptx_eq_ref"] = same_bits(outs[True], ref)
                rec["ptx_eq_portable"] = same_bits(outs[True], outs[False])
            ok &= all(v for k, v in rec.items() if k.endswith(("_ref", "_portable")))
            emit(rec)
    return ok


def decodes(dev):
    return ("portable", "ptx") if dev == "cuda" else ("portable",)


def check_gemm(G, dev):
    """Identity activations (C = the decoded weights) and random grouped GEMMs, both decodes, both operand forms."""
    ok = True
    K, N = 512, 256
    eye = torch.eye(K, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor([0, K], dtype=torch.int32, device=dev)
    j = torch.arange(K // 2, device=dev)
    r = torch.arange(N, device=dev)
    p = ((j[None, :] + r[:, None]) % 256).to(torch.uint8)[None]  # [1, N, K/2]
    lo = 0 if dev == "cuda" else 2  # as in check_decode; scales <= 252 keep every weight finite (no inf * 0)
    s = ((r[:, None] + 37 * torch.arange(K // 32, device=dev)[None, :]) % 253).clamp(lo).to(torch.uint8)[None]
    pt = ((torch.arange(N // 2, device=dev)[None, :] + torch.arange(K, device=dev)[:, None]) % 256).to(torch.uint8)
    st = ((torch.arange(K, device=dev)[:, None] + 37 * torch.arange(N // 32, device=dev)[None, :]) % 253).clamp(lo)
    pt, st = pt[None], st.to(torch.uint8)[None]  # stored [K, N/2]: the transposed (backward) layout
    want = {False: ref_decode(p[0], s[0]).float().T, True: ref_decode(pt[0], st[0]).float()}
    tiles = {"bm16": dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4),
             "bm128": dict(BM=128, BN=64, BK=64, num_warps=8, num_stages=4)}
    for trans in (False, True):
        for tname, cfg in tiles.items():
            for split in (False, True):
                res = {}
                for dec in decodes(dev):
                    set_mode(dec, split)
                    w = (pt, st) if trans else (p, s)
                    res[dec] = G.mxfp4_grouped_gemm(eye, *w, offs, trans_w=trans, config=cfg)
                rec = {"check": "identity_gemm", "trans_w": trans, "tile": tname, "split": split}
                for dec, c in res.items():
                    rec[f"{dec}_eq_ref"] = same_f32(c, want[trans], bits=False)
                if "ptx" in res:
                    rec["ptx_eq_portable"] = same_f32(res["ptx"], res["portable"])
                ok &= all(v for k, v in rec.items() if k.endswith(("_ref", "_portable")))
                emit(rec)
    # random grouped GEMMs with gathers / scatters / fused GLU: same operands, same MMA order -> identical bits
    gen = torch.Generator(device=dev).manual_seed(0)
    E, D, I, T, k = 8, 256, 384, 200 if dev == "cuda" else 12, 2
    wp = torch.randint(0, 256, (E, I, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    ws = torch.randint(110, 135, (E, I, D // 32), dtype=torch.uint8, device=dev, generator=gen)
    bp = torch.randint(0, 256, (E, I, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    dp = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev, generator=gen)
    ds = torch.randint(110, 135, (E, D, I // 32), dtype=torch.uint8, device=dev, generator=gen)
    idx = torch.rand(T, E, device=dev, generator=gen).topk(k, -1).indices
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.searchsorted(flat[order], torch.arange(E + 1, device=dev)).to(torch.int32)
    tok = (order // k).to(torch.int32)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=gen)
    h = torch.randn(T * k, I, device=dev, dtype=torch.bfloat16, generator=gen)
    g = torch.randn(T * k, D, device=dev, dtype=torch.bfloat16, generator=gen).float()  # dgate/dup-like (fp32)
    calls = {
        "gate_up_silu": lambda: G.mxfp4_grouped_gemm(x, wp, ws, offs, a_rows=tok, dual="out", act="silu",
                                                      b_packed=bp, b_scale=ws, out_dtype=torch.bfloat16),
        "down_scatter": lambda: G.mxfp4_grouped_gemm(h, dp, ds, offs, c_rows=order.to(torch.int32),
                                                      num_c_rows=T * k),
        "bwd_dual_in": lambda: G.mxfp4_grouped_gemm(g, dp, ds, offs, trans_w=True, dual="in", a2=g.flip(0),
                                                     b_packed=dp.flip(0), b_scale=ds),
    }
    for name, fn in calls.items():
        for split in (False, True):
            res = {}
            for dec in decodes(dev):
                set_mode(dec, split)
                res[dec] = fn().float()
            rec = {"check": "random_gemm", "call": name, "split": split}
            if "ptx" in res:
                rec["ptx_eq_portable"] = same_f32(res["ptx"], res["portable"])
                ok &= rec["ptx_eq_portable"]
            emit(rec)
    set_mode("ptx")
    return ok


def timing(G, M, tokens, variants):
    moe.DEV = "cuda"
    mod = moe.make_mxfp4_weights(M)
    per_expert_bytes = 3 * moe.INTER * moe.D * (0.5 + 1 / 32)
    for n in tokens:
        x = torch.randn(n, moe.D, device="cuda", dtype=torch.bfloat16)
        idx, _ = moe.routing(n, seed=n)
        order, offsets = M._route(idx, moe.E, sync_ok=False)
        tok = (order // moe.TOPK).to(torch.int32)
        rows = n * moe.TOPK
        hh = torch.randn(rows, moe.INTER, device="cuda", dtype=torch.bfloat16)
        active = int((offsets[1:] > offsets[:-1]).sum())
        fns = {
            "gate_up": lambda: G.mxfp4_grouped_gemm(x, mod.w1_packed, mod.w1_scale, offsets, a_rows=tok, dual="out",
                                                    act="silu", b_packed=mod.w3_packed, b_scale=mod.w3_scale,
                                                    out_dtype=torch.bfloat16),
            "down": lambda: G.mxfp4_grouped_gemm(hh, mod.w2_packed, mod.w2_scale, offsets,
                                                 c_rows=order.to(torch.int32), num_c_rows=rows),
        }
        for vname, (dec, split) in variants.items():
            set_mode(dec, split)
            ms = {k: moe.bench(fn, warm=2, rep=10 if n < 16384 else 5) for k, fn in fns.items()}
            total = ms["gate_up"] + ms["down"]
            emit({"check": "time", "tokens": n, "decode": vname, "gate_up_ms": round(ms["gate_up"], 4),
                  "down_ms": round(ms["down"], 4), "total_ms": round(total, 4),
                  "anchor_grouped_mm_ms": moe.ANCHOR_MS.get(n),
                  "speedup_vs_anchor": round(moe.ANCHOR_MS[n] / total, 3) if n in moe.ANCHOR_MS else None,
                  "weight_TBps": round(active * per_expert_bytes / total / 1e9, 3),
                  "cfg_gate_up": G.default_config(rows, moe.E, moe.INTER, moe.D, "out"),
                  "cfg_down": G.default_config(rows, moe.E, moe.D, moe.INTER)})
        x = hh = fns = None  # free before the next size
        torch.cuda.empty_cache()
    set_mode("ptx")


# ---- --count: compile for sm_90 without a GPU and count SASS of the main loop


def count(G):
    import triton
    from triton.backends.compiler import GPUTarget

    kern = G._mxfp4_grouped_gemm_kernel
    cu = triton.knobs.nvidia.cuobjdump.path
    E, D, I = moe.E, moe.D, moe.INTER
    cases = {  # name: (tokens, N, K, dual, act, trans_w): the module's default tile of each GEMM at that size
        "fwd_64tok_gate_up": (64, I, D, "out", 2, False),
        "fwd_64tok_down": (64, D, I, None, 0, False),
        "fwd_1ktok_gate_up": (1024, I, D, "out", 2, False),
        "fwd_1ktok_down": (1024, D, I, None, 0, False),
        "fwd_16ktok_gate_up": (16384, I, D, "out", 2, False),
        "fwd_16ktok_down": (16384, D, I, None, 0, False),
        "bwd_dual_in_16ktok": (16384, D, I, "in", 0, True),
    }
    only = os.environ.get("COUNT_CASES")
    for name, (tokens, N, K, dual, act, trans) in cases.items():
        if only and name not in only.split(","):
            continue
        cfg = G.default_config(tokens * moe.TOPK, E, N, K, dual, trans)
        BM, BN, BK, warps, stages = (cfg[x] for x in ("BM", "BN", "BK", "num_warps", "num_stages"))
        perm = bool(cfg.get("PERM")) and not trans
        variants = ((False, False), (True, False)) if os.environ.get("COUNT_PORTABLE") else ((True, False),)
        for ptx, split in variants:
            dual_id = G.DUALS[dual]
            consts = dict(BM=BM, BN=BN, BK=BK, E_CHUNK=1024, NUM_E_CHUNKS=1, TRANS_W=trans, DUAL=dual_id, ACT=act,
                          LINEAR_UP=False, GATHER_A=not trans, A_DIV=1,
                          SCATTER_C=dual_id == 0 and not trans, DEQ=0, OP_F32=False, PTX=ptx, SPLIT=split,
                          PERM=perm, A_KPERM=bool(cfg.get("AK")) and perm,
                          EVEN=not trans and K % BK == 0 and N % BN == 0, ROW_EXPERT=False)
            ptrs = {"a_ptr": "*bf16", "a2_ptr": "*bf16", "c_ptr": "*bf16" if dual_id == 1 else "*fp32"}
            sig, attrs = {}, {}
            for i, a in enumerate(kern.arg_names):
                if a in consts:
                    sig[a] = "constexpr"
                    continue
                sig[a] = "fp32" if a.startswith("beta") else ptrs.get(a, "*u8" if a[:2] in ("w_", "ws", "b_", "bs")
                                                                       else ("*i32" if a.endswith("_ptr") else "i32"))
                if not a.startswith("beta"):
                    attrs[(i,)] = [["tt.divisibility", 16]]  # pointers, strides and sizes at K3 shapes
            src = triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
            ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps,
                                                                                 num_stages=stages))
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(ck.asm["cubin"])
                f.flush()
                res = subprocess.check_output([cu, "-res-usage", f.name]).decode()
                sass = subprocess.check_output([cu, "-sass", f.name]).decode()
            ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
            body = []
            for a, t in ins:  # the main loop: the longest backward branch
                m = re.search(r"BRA[^0-9]*0x([0-9a-f]+)", t)
                if m and int(m.group(1), 16) < a:
                    cand = [x for x in ins if int(m.group(1), 16) <= x[0] <= a]
                    body = cand if len(cand) > len(body) else body
            weights = BN * BK * (2 if dual else 1)
            ops = {}
            for _, t in body:
                op = t.split()[1] if t.startswith("@") else t.split()[0]
                ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + 1
            if os.environ.get("COUNT_SASS_DIR"):
                Path(os.environ["COUNT_SASS_DIR"], name + ".sass").write_text("\n".join(t for _, t in body))
                Path(os.environ["COUNT_SASS_DIR"], name + ".ttgir").write_text(ck.asm["ttgir"])
            print(json.dumps({"case": name, "tile": [BM, BN, BK, warps, stages], "perm": perm,
                              "decode": "ptx" if ptx else "portable", "split": split,
                              "regs": int(re.search(r"REG:(\d+)", res).group(1)),
                              "stack_bytes": int(re.search(r"STACK:(\d+)", res).group(1)),
                              "loop_sass": len(body),
                              "sass_per_weight": round(len(body) * 32 * warps / weights, 2),
                              "top_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8])}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 1024, 16384])
    ap.add_argument("--split", action="store_true", help="also time the parity-split operands (ptx decode)")
    ap.add_argument("--count", action="store_true", help="no GPU: sm_90 SASS counts of the main loop")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: the checks of the portable path")
    args = ap.parse_args()
    G, M, note = moe.load_modules()
    if args.count:
        return count(G)
    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke / --count)")
    emit({"check": "env", "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
          "torch": torch.__version__, "triton": triton.__version__, "note": note})
    ok = check_decode(G, dev)
    ok &= check_gemm(G, dev)
    emit({"check": "summary", "all_bit_exact": ok})
    if dev == "cuda":
        variants = {"portable": ("portable", False), "ptx": ("ptx", False)}
        if args.split:
            variants["ptx_split"] = ("ptx", True)
        timing(G, M, args.tokens, variants)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mxfp4_decode_check.jsonl").write_text("".join(json.dumps(r) + "\n" for r in OUT))
    print(f"wrote {out / 'mxfp4_decode_check.jsonl'} in {time.time() - T0:.0f} s; bit-exact: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
