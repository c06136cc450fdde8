"""The packed MXFP4 experts against bf16 `torch._grouped_mm` on the same weights, in one process, at K3's routed
expert shapes (896 experts, top-16, latent 3584, expert width 3072; one layer).

    python bench/moe.py --out bench/results/moe_h100.json [--tokens 1 8 64 1024 16384] [--rounds 5]
    python bench/moe.py --tokens 64 1024 --variant triton wgmma=0 --variant tables table_free=0
    mkdir -p .mbase && git archive BASE src kernels | tar x -C .mbase      # here (.mbase ignored, then carried)
    python bench/moe.py --tokens 64 1024 --base .mbase                    # another tree's packed experts too
    python bench/moe.py --w4a8 --out bench/results/moe_h100.json          # also MXFP8 activations (W4A8)
    TRITON_INTERPRET=1 python bench/moe.py --smoke                        # toy shapes on the CPU: checks the script

Rows, per token count; every row is timed once per round and the rounds interleave them (a drift of the GPU's
clocks hits all alike); the medians are reported:
  packed   `PackedMXFP4Experts.forward` as the model calls it (bf16 x, the router's topk): routing, gate+up with
           the GLU fused, down, the weighted sum
  bf16     the same function on the exactly decoded bf16 weights: the routes sorted, x gathered, `torch._grouped_mm`
           gate+up (one [E, 2I, D] weight), the GLU, `torch._grouped_mm` down, unsorted and weighted
  NAME     the packed forward under `--variant NAME KEY=VALUE ...`: kernel options of `kimi3_kernels.mxfp4.variant`
           (wgmma=0/1, table_free=0/1, l2_prefetch=BYTES), attributes of the module (UNSORTED_MAX_ROUTES=N,
           DEQUANT_MIN_ROWS_PER_EXPERT=N) or tile table entries (tiles.TABLE.BM.out|down=BN/BK/warps/stages[/x],
           TABLE one of _TILES, _PERM_TILES, _WGMMA_TILES, _WGMMA_ROW_TILES; see kimi3_kernels/mxfp4/tiles.py)
  base     the packed forward of another tree's code (`--base DIR`), on the same weight buffers
  w4a8     (`--w4a8`) the packed forward with `activation_format="mxfp8"`: x and the GLU output quantised to MXFP8,
           their values (exact in bf16) through the bf16-activation kernels, as the module runs bf16 activations
  w4a8_fp8 (`--w4a8`) the same with both GEMMs on FP8 tensor cores (kimi3_kernels/mxfp4/w4a8.py, the module's
           `_MXFP8_GEMM = "fp8"`); both W4A8 rows are also compared with the emulated W4A8 path (fp32 on the
           fake-quantised values) on the first four tokens
Up to --graph-max tokens (default 64) a row is CUDA-graph replays (what a decode step pays), above it eager calls
timed by CUDA events. Each row's output is compared with an fp32 decode-then-matmul on the first four tokens and
with the packed row's on all tokens (max abs error / max abs value; 0.0: the same bits). `--backward` adds
forward+backward of packed and bf16 (x requires grad).
An H100 holds the bf16 weights (59 GB) beside the packed ones up to ~4K tokens; past that the bf16 row reports an
out-of-memory error there. About 3 minutes on one GPU at the default token counts.
"""

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _timing import Results, capture, rel  # noqa: E402

K3 = dict(E=896, TOPK=16, D=3584, I=3072)
SMOKE = dict(E=8, TOPK=2, D=128, I=256)
PACKAGES = ("kimi3_kernels", "transformers_kimi3")


# ----------------------------------------------------------------------------------------------------------------
# the code under test: this tree's, and optionally another's under other module names


def _bare_package(name, path):
    """`name` as a package over `path` without running its __init__ (neither the model nor Transformers needed)."""
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod = importlib.util.module_from_spec(spec)
    mod.__path__ = [str(path)]
    sys.modules[name] = mod


def load_tree(root):
    """(PackedMXFP4Experts, glu(kind)) from the tree at `root` (its src/ and kernels/)."""
    sys.path.insert(0, str(root / "kernels"))
    _bare_package("transformers_kimi3", root / "src" / "transformers_kimi3")
    try:
        if (root / "src" / "transformers_kimi3" / "mxfp4_experts.py").exists():
            experts = importlib.import_module("transformers_kimi3.mxfp4_experts")
            act = importlib.import_module("transformers_kimi3.activations")
            importlib.import_module("transformers_kimi3.kernels").mxfp4_ops()  # its lazy import, while this tree's

            def glu(kind):
                return act.GLUActivation("situ", 4.0, 25.0) if kind == "situ" else act.GLUActivation("silu")
            return experts.PackedMXFP4Experts, glu
        old = importlib.import_module("transformers_kimi3.mxfp4")  # a tree from before mxfp4_experts.py
        old._gemm_module(), old._decode_module()  # their lazy imports, while this tree's

        def glu(kind):
            return old.SiTUGLU(4.0, 25.0) if kind == "situ" else old.silu_glu
        return old.PackedMXFP4Experts, glu
    finally:
        sys.path.remove(str(root / "kernels"))


def load_base(folder):
    """load_tree(folder), its modules then renamed base_* (relative imports follow) and this tree's restored."""
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in PACKAGES}
    try:
        loaded = load_tree(Path(folder).resolve())
    finally:
        theirs = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in PACKAGES}
        sys.modules.update(ours)
    for name, mod in theirs.items():
        sys.modules["base_" + name] = mod
        if getattr(mod, "__package__", None):
            mod.__package__ = "base_" + mod.__package__
    return loaded


# ----------------------------------------------------------------------------------------------------------------
# weights, inputs, the bf16 peer, the fp32 reference


def make_packed(cls, glu, S, device):
    """The packed experts with random bytes (E8M0 scales 2^-9..2^-6: weights of a trained model's size)."""
    mod = cls(S["E"], S["D"], S["I"], glu, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for name, buf in mod.named_buffers():
        if name.endswith("_packed"):
            buf.copy_(torch.randint(0, 256, buf.shape, device=device, dtype=torch.uint8, generator=g))
        else:
            buf.copy_(torch.randint(118, 122, buf.shape, device=device, dtype=torch.uint8, generator=g))
    return mod


def share_buffers(cls, glu, mod, S):
    """Another tree's module over `mod`'s buffers (built on the meta device: no second copy of the weights)."""
    other = cls(S["E"], S["D"], S["I"], glu, device="meta")
    for name, buf in mod.named_buffers():
        setattr(other, name, buf)
    return other


def bf16_weights(mod, S):
    """w13 [E, 2I, D] (gate rows, then up) and w2 [E, D, I], the exact bf16 values, decoded a few experts at a
    time."""
    from transformers_kimi3.mxfp4 import decode_mxfp4

    E, D, I = S["E"], S["D"], S["I"]
    dev = mod.w1_packed.device
    w13 = torch.empty(E, 2 * I, D, device=dev, dtype=torch.bfloat16)
    w2 = torch.empty(E, D, I, device=dev, dtype=torch.bfloat16)
    for e0 in range(0, E, 8):
        sl = slice(e0, e0 + 8)
        w13[sl, :I] = decode_mxfp4(mod.w1_packed[sl], mod.w1_scale[sl], torch.bfloat16)
        w13[sl, I:] = decode_mxfp4(mod.w3_packed[sl], mod.w3_scale[sl], torch.bfloat16)
        w2[sl] = decode_mxfp4(mod.w2_packed[sl], mod.w2_scale[sl], torch.bfloat16)
    return w13, w2


def routing(n, S, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.rand(n, S["E"], device=device, generator=g).topk(S["TOPK"], dim=-1).indices
    w = torch.rand(n, S["TOPK"], device=device, generator=g)
    return idx, w / w.sum(-1, keepdim=True)


def grouped_forward(x, idx, w, w13, w2, glu):
    """The bf16 peer: PackedMXFP4Experts.forward's function through torch._grouped_mm."""
    T, k = idx.shape
    E, I = w13.shape[0], w2.shape[2]
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    gu = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)
    h = glu(gu[:, :I], gu[:, I:])
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    out = torch.empty(T * k, y.shape[1], device=x.device, dtype=torch.float32).index_copy_(0, order, y.float())
    return torch.bmm(w.float().view(T, 1, k), out.view(T, k, -1)).view(T, -1).to(x.dtype)


def fp32_reference(mod, x, idx, w, kind, tokens):
    """Decode-then-matmul in fp32 for the first `tokens` tokens, the GLU output rounded to bf16 as every row does."""
    from transformers_kimi3.activations import glu
    from transformers_kimi3.mxfp4 import decode_mxfp4

    out = torch.zeros(tokens, x.shape[1], device=x.device)
    for t in range(tokens):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            w1, w3, w2 = (decode_mxfp4(getattr(mod, f"{n}_packed")[e], getattr(mod, f"{n}_scale")[e])
                          for n in ("w1", "w3", "w2"))
            xf = x[t].float()
            h = glu(w1 @ xf, w3 @ xf, kind, 4.0, 25.0).bfloat16().float()
            out[t] += w[t, j] * (w2 @ h)
    return out


def emulated_w4a8(mod, x, idx, w, tokens):
    """The W4A8 module's exact path (fp32 on the fake-quantised MXFP8 activations) for the first `tokens` tokens."""
    mod._kernels = lambda x, grad=False: None
    try:
        with torch.no_grad():
            return mod(x[:tokens], idx[:tokens], w[:tokens])
    finally:
        del mod._kernels


# ----------------------------------------------------------------------------------------------------------------
# variants


def parse_variant(words):
    """['NAME', 'KEY=VALUE', ...] -> (NAME, {option: value}, {attribute: value}, {(table, BM, dual): tile})."""
    name, options, attrs, tiles = words[0], {}, {}, {}
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key.startswith("tiles."):
            _, table, bm, gemm = key.split(".")
            tiles[table, int(bm), "out" if gemm == "out" else None] = tuple(int(v) for v in value.split("/"))
        elif key.isupper():
            attrs[key] = int(value)
        else:
            options[key] = int(value) if key == "l2_prefetch" else bool(int(value))
    return name, options, attrs, tiles


@contextlib.contextmanager
def applied(variant, mod):
    """The packed experts under a variant (see the module docstring) for the duration of the block."""
    from kimi3_kernels import mxfp4
    from kimi3_kernels.mxfp4 import tiles as tile_tables

    _, options, attrs, tiles = variant
    saved = {t: dict(getattr(tile_tables, t)) for t, _, _ in tiles}
    for (table, bm, dual), tile in tiles.items():
        getattr(tile_tables, table)[bm if table == "_TILES" else (bm, dual)] = tile
    for k, v in attrs.items():
        setattr(mod, k, v)
    try:
        with mxfp4.variant(**options):
            yield
    finally:
        for k in attrs:
            delattr(mod, k)
        for t, table in saved.items():
            getattr(tile_tables, t).clear()
            getattr(tile_tables, t).update(table)


# ----------------------------------------------------------------------------------------------------------------
# timing


class Timer:
    """One row's timing: a CUDA graph captured once and replayed `rep` times per round (graph=True), or eager calls
    between CUDA events; on the CPU (--smoke) wall time."""

    def __init__(self, fn, ctx, graph, device, rep):
        self.fn, self.ctx, self.rep, self.device = fn, ctx, rep, device
        self.graph = None
        if graph and device.type == "cuda":
            with ctx():
                self.graph = capture(fn)

    def __call__(self):
        """Milliseconds per call, this round."""
        if self.device.type != "cuda":
            with self.ctx():
                t = time.perf_counter()
                self.fn()
                return (time.perf_counter() - t) * 1e3
        call = self.graph.replay if self.graph is not None else self.fn
        with self.ctx() if self.graph is None else contextlib.nullcontext():
            call()
            torch.cuda.synchronize()
            if self.graph is not None:  # replays back to back: the launch latency is not the call's
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(self.rep):
                    call()
                b.record()
                torch.cuda.synchronize()
                return a.elapsed_time(b) / self.rep
            times = []
            for _ in range(self.rep):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            return statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 1024, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--graph-max", type=int, default=64, help="CUDA-graph replays up to this many tokens")
    ap.add_argument("--act", choices=("silu", "situ"), default="situ", help="the experts' GLU (K3: situ)")
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                    help="a row of the packed experts under other kernel options, attributes or tiles (repeatable)")
    ap.add_argument("--base", help="another tree's folder (its src/ and kernels/): its packed experts as a row")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 peer (and its 59 GB of weights)")
    ap.add_argument("--w4a8", action="store_true", help="a row with MXFP8 activations (W4A8 kernels)")
    ap.add_argument("--backward", action="store_true", help="also time forward+backward (eager)")
    ap.add_argument("--out", help="results JSON (rewritten after every token count)")
    ap.add_argument("--label", help="the tree's label in the results (default: git describe)")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU (needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    S = SMOKE if args.smoke else K3
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/moe.py needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")

    cls, glu_of = load_tree(ROOT)
    base = load_base(args.base) if args.base else None
    if args.smoke:  # the kernels on CPU tensors, under the interpreter
        from transformers_kimi3 import kernels
        kernels.kernel_device = lambda t: True
    from transformers_kimi3.activations import GLUActivation

    variants = [parse_variant(v) for v in args.variant]
    res = Results(args.out, tree_label=args.label, shapes=S, act=args.act, base=args.base,
                  variants={v[0]: args.variant[i][1:] for i, v in enumerate(variants)})
    mod = make_packed(cls, glu_of(args.act), S, device)
    base_mod = share_buffers(base[0], base[1](args.act), mod, S) if base else None
    a8_mod = None
    if args.w4a8:
        a8_mod = share_buffers(cls, glu_of(args.act), mod, S)
        a8_mod.activation_format = "mxfp8"
        fp8_mod = share_buffers(cls, glu_of(args.act), mod, S)
        fp8_mod.activation_format, fp8_mod._MXFP8_GEMM = "mxfp8", "fp8"
    w13 = w2 = None
    if not args.no_bf16:
        w13, w2 = bf16_weights(mod, S)
    peer_glu = GLUActivation("situ", 4.0, 25.0) if args.act == "situ" else GLUActivation("silu")
    res.meta.update(kernel_path=mod.kernel_path, packed_GB=mod.weight_bytes / 1e9,
                    bf16_GB=None if w13 is None else (w13.numel() + w2.numel()) * 2 / 1e9)
    none = contextlib.nullcontext
    for n in args.tokens:
        x = torch.randn(n, S["D"], device=device, dtype=torch.bfloat16)
        idx, w = routing(n, S, device, seed=n)
        rows = {"packed": (lambda: mod(x, idx, w), none)}
        if w13 is not None:
            rows["bf16"] = (lambda: grouped_forward(x, idx, w, w13, w2, peer_glu), none)
        for v in variants:
            rows[v[0]] = (lambda: mod(x, idx, w), lambda v=v: applied(v, mod))
        if base_mod is not None:
            rows["base"] = (lambda: base_mod(x, idx, w), none)
        if a8_mod is not None:
            rows["w4a8"] = (lambda: a8_mod(x, idx, w), none)
            rows["w4a8_fp8"] = (lambda: fp8_mod(x, idx, w), none)
        graph = n <= args.graph_max
        ref_tokens = min(n, 4)
        ref = fp32_reference(mod, x, idx, w, args.act, ref_tokens)
        row = dict(tokens=n, timing="graph replay" if graph else "eager, CUDA events", ms={}, rel_err_vs_fp32={},
                   rel_err_vs_packed={})
        timers, outs = {}, {}
        with torch.no_grad():
            for name, (fn, ctx) in rows.items():
                try:
                    with ctx():
                        outs[name] = fn()
                    row["rel_err_vs_fp32"][name] = rel(outs[name][:ref_tokens], ref)
                    if name != "packed":  # all tokens; 0.0: the same bits
                        row["rel_err_vs_packed"][name] = rel(outs[name], outs["packed"])
                    timers[name] = Timer(fn, ctx, graph, device, rep=50 if graph else 5)
                except Exception as ex:  # noqa: BLE001 - out of memory, a tile that does not compile: reported
                    row["ms"][name] = f"{type(ex).__name__}: {str(ex)[:160]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            rounds = {name: [] for name in timers}
            for _ in range(args.rounds):
                for name, timer in timers.items():
                    rounds[name].append(timer())
        for name in ("w4a8", "w4a8_fp8"):
            if name in outs:
                row[f"{name}_rel_err_vs_emulation"] = rel(outs[name][:ref_tokens],
                                                          emulated_w4a8(a8_mod, x, idx, w, ref_tokens))
        for name, t in rounds.items():
            row["ms"][name] = round(statistics.median(t), 4)
        row["rounds_ms"] = {name: [round(v, 4) for v in t] for name, t in rounds.items()}
        med = {k: v for k, v in row["ms"].items() if isinstance(v, float)}
        if "packed" in med:
            row["bf16_over_packed"] = round(med["bf16"] / med["packed"], 3) if "bf16" in med else None
            row["over_packed"] = {k: round(v / med["packed"], 3) for k, v in med.items() if k != "packed"}
        if args.backward:
            row["fwd_bwd_ms"] = backward_rows(mod, x, idx, w, w13, w2, peer_glu, device)
        del timers, outs
        res.add(**row)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def backward_rows(mod, x, idx, w, w13, w2, glu, device):
    """Forward+backward of the packed experts and of the bf16 peer (x requires grad; weights frozen)."""
    dy = torch.randn_like(x)
    out = {}
    fns = {"packed": lambda xr: mod(xr, idx, w)}
    if w13 is not None:
        fns["bf16"] = lambda xr: grouped_forward(xr, idx, w, w13, w2, glu)
    for name, fn in fns.items():
        def step(fn=fn):
            fn(x.detach().requires_grad_()).backward(dy)
        try:
            out[name] = round(Timer(step, contextlib.nullcontext, False, device, rep=3)(), 4)
        except Exception as ex:  # noqa: BLE001 - reported, not fatal
            out[name] = f"{type(ex).__name__}: {str(ex)[:160]}"
    return out


if __name__ == "__main__":
    main()
