"""Plot a bench/kda.py results file: ours against fla (timed in the same process) per shape, the forward without
autograd (prefill) and forward+backward (training), ms against T. Needs matplotlib (not a project requirement).

    python bench/plot_kda.py --json bench/results/kda_h200.json --out bench/results/kda_h200.png
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import load_runs  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "kda_h200.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kda_h200.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


if __name__ == "__main__":
    main()
