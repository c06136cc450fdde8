"""Plot of the chunked KDA timings in bench/results/kda_h200.json: forward and forward+backward ms against T.

    python bench/plot_kda.py [--json bench/results/kda_h200.json] [--out bench/results/kda_h200.png]

The newest timings with fla 0.6.0 in the same process (H=32: "session_38d30ed", H=96: "session_fe825ec"; one process
per head count, so every point pairs ours with fla measured beside it); H=32 with the softplus gate, H=96 with K3's, T = 4K / 16K / 64K.
Needs matplotlib (not a project requirement).
"""
from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(HERE, "results", "kda_h200.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kda_h200.png"))
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(args.json))
    # H=32 from the sixth session (38d30ed), H=96 from the fifth (fe825ec): each against fla in its own process
    h32 = res["session_38d30ed"]["time_h32_38d30ed"]
    h96 = res["session_fe825ec"]["time_h96_fe825ec"]
    rows = [dict(r, commit=run["git_commit"]) for run in (h32, h96) for r in run["timings"] if "fla_fwd_ms" in r]

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], "fwd", "forward"), (axes[1], "fwdbwd", "forward + backward")):
        for H, color in ((32, "tab:blue"), (96, "tab:red")):
            rs = sorted((r for r in rows if r["H"] == H), key=lambda r: r["T"])
            gate = "K3 gate" if rs[0]["gate"].startswith("k3") else "softplus gate"
            ax.plot([r["T"] for r in rs], [r[f"ours_{key}_ms"] for r in rs], "o-", color=color,
                    label=f"ours H={H} ({gate}), {rs[0]['commit']}")
            fla = [r for r in rs if f"fla_{key}_ms" in r]
            ax.plot([r["T"] for r in fla], [r[f"fla_{key}_ms"] for r in fla], "s--", color=color, alpha=0.7,
                    label=f"fla 0.6.0 H={H}, same process")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ts = sorted({r["T"] for r in rows})
        ax.set_xticks(ts)
        ax.set_xticklabels([f"{t // 1024}K" for t in ts])
        ax.set_xlabel("T (tokens, B=1)")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"chunked KDA {title}, bf16, K=V=128")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['gpu']}, torch {res['torch']}, triton {res['triton']}: lower is better", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
