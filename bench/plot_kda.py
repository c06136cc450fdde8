"""Plot of the chunked KDA timings in bench/results/kda_h200.json: forward and forward+backward ms against T.

    python bench/plot_kda.py [--json bench/results/kda_h200.json] [--out bench/results/kda_h200.png]

Every point pairs ours with fla 0.6.0 timed in the same process on the same inputs; H=32 with the softplus gate,
H=96 with K3's, T = 4K / 16K / 64K. The forward panel is the inference forward as shipped (16-token kernels,
"session_3f60a47_h100": an H100, the only GPU the device tool gave for it); the forward+backward panel is the
training path on the H200 (H=32: "session_38d30ed", H=96: "session_fe825ec", one process per head count).
Needs matplotlib (not a project requirement).
"""
from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
GATES = {"k3": "K3 gate", "sp": "softplus gate"}


def forward_rows(res):
    run = res["session_3f60a47_h100"]["ab"]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return [dict(H=r["H"], T=r["T"], gate=r["gate"], ours=med(r["fwd_ms"]["new"]), fla=med(r["fwd_ms"]["fla"]))
            for r in run["rows"]], f"{run['gpu']}, {run['git_commit']}"


def fwdbwd_rows(res):
    runs = (res["session_38d30ed"]["time_h32_38d30ed"], res["session_fe825ec"]["time_h96_fe825ec"])
    rows = [dict(H=r["H"], T=r["T"], gate="k3" if r["gate"].startswith("k3") else "sp", ours=r["ours_fwdbwd_ms"],
                 fla=r["fla_fwdbwd_ms"], commit=run["git_commit"])
            for run in runs for r in run["timings"] if "fla_fwdbwd_ms" in r]
    return rows, f"{res['gpu']}, " + " / ".join(run["git_commit"] for run in runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(HERE, "results", "kda_h200.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kda_h200.png"))
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(args.json))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = ((axes[0], "inference forward", *forward_rows(res)), (axes[1], "forward + backward", *fwdbwd_rows(res)))
    for ax, title, rows, where in panels:
        for H, color in ((32, "tab:blue"), (96, "tab:red")):
            rs = sorted((r for r in rows if r["H"] == H), key=lambda r: r["T"])
            ts = [r["T"] for r in rs]
            ax.plot(ts, [r["ours"] for r in rs], "o-", color=color, label=f"ours H={H} ({GATES[rs[0]['gate']]})")
            ax.plot(ts, [r["fla"] for r in rs], "s--", color=color, alpha=0.7, label=f"fla 0.6.0 H={H}, same process")
            for r in rs:
                ax.annotate(f"{r['fla'] / r['ours']:.2f}x", (r["T"], r["ours"]), textcoords="offset points",
                            xytext=(5, 5), fontsize=7, color=color)
        ts = sorted({r["T"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ts)
        ax.set_xticklabels([f"{t // 1024}K" for t in ts])
        ax.set_xlabel("T (tokens, B=1)")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"chunked KDA {title}, bf16, K=V=128\n{where}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"torch {res['torch']}, triton {res['triton']}: lower is better; labels: fla / ours", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
