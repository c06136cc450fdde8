"""Redraw the plots of bench/results from their JSON files (needs matplotlib, not a project requirement):

    python bench/plot.py kda [--json bench/results/kda_h200.json] [--out bench/results/kda_h200.png]
    python bench/plot.py e2e [--json bench/results/e2e_h200.json] [--out bench/results/e2e_h200.png]

`kda`: a bench/kda.py results file, ours against fla (timed in the same process) per shape, the forward without
autograd (prefill) and forward+backward (training), ms against T.
`e2e`: a bench/e2e.py results file (4.3B Kimi Linear config): prefill tokens/s by prompt length (native and ours, 2K
to 1M), decode tokens/s by batch after a 1,024-token prompt (native, ours eager, ours static cache) and long-prompt
prefill time and peak memory (ours chunked, native in one pass). Each point is the newest row of its kind over the
file's runs; the titles name the trees the points come from.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import load_runs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# ------------------------------------------------------------------------------------------------ kda
GATES = {"k3": "K3 gate", "sp": "softplus gate"}
PANELS = (("fwd_ms", "forward without autograd (prefill)"), ("fwdbwd_ms", "forward + backward (training)"))


def pairs(rows, key):
    """{H: [(T, ours_ms, fla_ms, gate)]} over the fixed-length time rows that have `key` for both (rows in run
    order: the newest of each shape wins)."""
    ms = {(r["impl"], r["H"], r["T"]): r for r in rows
          if r.get("section") == "time" and "varlen" not in r and r.get(key) is not None}
    out = {}
    for (impl, H, T), r in sorted(ms.items()):
        theirs = ms.get(("fla", H, T))
        if impl == "ours" and theirs:
            out.setdefault(H, []).append((T, r[key], theirs[key], r["gate"]))
    return out


def plot_kda(args, plt):
    """bench/kda.py's time rows: ours against fla per shape, prefill and training panels, ms against T."""
    runs = load_runs(args.json)
    rows = [r for run in runs for r in run["rows"]]
    panels = [(title, pairs(rows, key)) for key, title in PANELS]
    panels = [(title, data) for title, data in panels if data]
    if not panels:
        raise SystemExit(f"{args.json}: no time rows with both ours and fla")
    fig, axes = plt.subplots(1, len(panels), figsize=(max(8, 6 * len(panels)), 5), squeeze=False)
    for ax, (title, data) in zip(axes[0], panels):
        for (H, pts), color in zip(sorted(data.items()), ("tab:blue", "tab:red", "tab:green")):
            ts = [p[0] for p in pts]
            ax.plot(ts, [p[1] for p in pts], "o-", color=color, label=f"ours H={H} ({GATES[pts[0][3]]})")
            ax.plot(ts, [p[2] for p in pts], "s--", color=color, alpha=0.7, label=f"fla H={H}")
            for T, ours, fla, _ in pts:
                ax.annotate(f"{fla / ours:.2f}x", (T, ours), textcoords="offset points", xytext=(5, 5), fontsize=7,
                            color=color)
        ts = sorted({p[0] for pts in data.values() for p in pts})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ts)
        ax.set_xticklabels([f"{t // 1024}K" for t in ts])
        ax.set_xlabel("T (tokens, B=1)")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"chunked KDA, {title}\nbf16, K=V=128", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    meta = runs[-1]["meta"]
    fig.suptitle(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, fla {meta.get('fla')}\n"
                 "lower is better; labels: fla / ours", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


# ------------------------------------------------------------------------------------------------ e2e
IMPLS = [("native", "native (Transformers + fla)"), ("ours", "ours, eager"),
         ("ours_static_graph", "ours, static cache + CUDA graph")]


MEMORY_GIB = {"H200": 139.8, "H100": 79.2}  # what torch can allocate on one card


def newest_rows(runs, key):
    """{key(row): (row, tree)} keeping the last run's row for each key; rows where key() is None are skipped."""
    out = {}
    for run in runs:
        for r in run["rows"]:
            k = key(r)
            if k is not None:
                out[k] = (r, run["meta"].get("tree") or run["meta"].get("commit"))
    return out


def trees(points):
    return ", ".join(sorted({c for _, c in points}))


def plot_e2e(args, plt):
    """bench/e2e.py's rows at the 4.3B config: prefill by prompt length, decode by batch, long prompts."""
    runs = [run for run in load_runs(args.json)  # the 4.3B config; K3-shaped runs name their model
            if not run["meta"].get("model", "").startswith("k3")]
    device = runs[-1]["meta"]["device"]
    memory = next((v for k, v in MEMORY_GIB.items() if k in device), None)

    dec = newest_rows(runs, lambda r: (r["impl"], r["batch"]) if r.get("stage") == "decode" and
                      r.get("prompt") == 1024 and "error" not in r else None)
    lon = newest_rows(runs, lambda r: (r["impl"], r["T"]) if r.get("stage") == "longest" and r.get("T") else None)
    batches = [b for b in (1, 8, 64) if all((i, b) in dec for i, _ in IMPLS)]
    if not batches:
        raise SystemExit("no batch size has a decode row for every implementation")

    pre = newest_rows(runs, lambda r: (r["impl"], r["T"]) if r.get("stage") in ("prefill", "longest") and
                      r.get("impl") in ("native", "ours") and r.get("T") and "error" not in r else None)

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(18, 4.6))
    for impl, label, style in (("native", "native (Transformers + fla), one pass", "o:"),
                               ("ours", "ours (Triton KDA; chunked from 128K)", "s-")):
        Ts = sorted(T for i, T in pre if i == impl)
        ys = [pre[(impl, T)][0]["tok_s"] for T in Ts]
        ax0.plot(Ts, ys, style, label=label)
        for t, y in zip(Ts, ys):
            ax0.annotate(f"{y / 1e3:.0f}k", (t, y), textcoords="offset points", xytext=(-8, 6), fontsize=7)
    ax0.set_xscale("log", base=2)
    Tall = sorted({T for _, T in pre})
    ax0.set_xticks(Tall, [f"{t // 2**20}M" if t >= 2**20 else f"{t // 1024}K" for t in Tall])
    ax0.set_xlabel("prompt tokens")
    ax0.set_ylabel("prefill tokens/s")
    ax0.set_ylim(bottom=0)
    ax0.legend(fontsize=8)
    ax0.set_title(f"Prefill throughput vs prompt length, B=1 ({trees(pre.values())})", fontsize=9)

    width = 0.27
    for k, (impl, label) in enumerate(IMPLS):
        xs = [i + (k - 1) * width for i in range(len(batches))]
        ys = [dec[(impl, b)][0]["tok_s"] for b in batches]
        bars = ax1.bar(xs, ys, width, label=label)
        ax1.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7)
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(batches)), [f"B={b}" for b in batches])
    ax1.set_ylabel("decode tokens/s (generate(), log scale)")
    ax1.set_title("Decode after a 1,024-token prompt "
                  f"({trees(dec[(i, b)] for i, _ in IMPLS for b in batches)})", fontsize=9)
    ax1.legend(fontsize=8, loc="upper left")

    pts = {T: r for (impl, T), (r, _) in lon.items() if impl == "ours" and "error" not in r}
    Ts = sorted(pts)
    ax2.plot(Ts, [pts[t]["s"] for t in Ts], "o-", color="C1", label="ours: prefill time (s)")
    for t in Ts:
        ax2.annotate(f"{pts[t]['s']:.1f} s", (t, pts[t]["s"]), textcoords="offset points", xytext=(-10, 6),
                     fontsize=7)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(Ts, [f"{t // 2**20}M" if t >= 2**20 else f"{t // 1024}K" for t in Ts])
    ax2.set_xlabel(f"prompt tokens (ours in {pts[Ts[0]]['chunk']:,}-token chunks)")
    ax2.set_ylabel("prefill time, s")
    ax3 = ax2.twinx()
    ax3.plot(Ts, [pts[t]["peak_gib"] for t in Ts], "s--", color="C2", label="ours: peak memory (GiB)")
    for t in Ts:
        ax3.annotate(f"{pts[t]['peak_gib']:.1f} GiB", (t, pts[t]["peak_gib"]), textcoords="offset points",
                     xytext=(-14, -13), fontsize=7, color="C2")
    if memory:
        ax3.set_ylim(0, memory * 1.04)
        ax3.axhline(memory, color="gray", lw=0.8, ls=":")
        ax3.text(Ts[0], memory * 0.95, f"GPU memory (~{memory:.0f} GiB)", fontsize=7, color="gray")
    nat = {T: r for (impl, T), (r, _) in lon.items() if impl == "native"}
    ok = sorted(T for T, r in nat.items() if "error" not in r)
    if ok:
        ax2.plot(ok, [nat[t]["s"] for t in ok], "o:", color="C0", label="native, one pass: time (s)")
        ax3.plot(ok, [nat[t]["peak_gib"] for t in ok], "s:", color="C0", mfc="none", label="native: peak (GiB)")
        for t in ok:
            ax2.annotate(f"{nat[t]['s']:.1f} s", (t, nat[t]["s"]), textcoords="offset points", xytext=(4, -10),
                         fontsize=7, color="C0")
    for T, r in sorted(nat.items()):
        if r.get("error") == "out of memory":
            ax3.plot([T], [memory or r.get("peak_gib", 0)], "x", color="C0", ms=10, mew=2, label=f"native, one pass: OOM at {T:,}")
    ax3.set_ylabel("peak GiB (torch allocator)")
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=8, loc="center left")
    ax2.set_title(f"Long-prompt prefill, bf16, B=1 ({trees(lon.values())})", fontsize=9)
    fig.suptitle(f"Kimi Linear 4.3B benchmark config on one {device} ({os.path.basename(args.json)})", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out} (prefill: {trees(pre.values())}; decode: {trees(dec.values())}; "
          f"longest: {trees(lon.values())})")


PLOTS = {"kda": (plot_kda, "kda_h200"), "e2e": (plot_e2e, "e2e_h200")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="plot", required=True)
    for name, (_, stem) in PLOTS.items():
        p = sub.add_parser(name, help=f"default: results/{stem}.json -> results/{stem}.png")
        p.add_argument("--json", default=str(RESULTS / f"{stem}.json"))
        p.add_argument("--out", default=str(RESULTS / f"{stem}.png"))
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS[args.plot][0](args, plt)


if __name__ == "__main__":
    main()
