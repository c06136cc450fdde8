"""Plot bench/results/e2e_h200.json: decode tokens/s by batch (native, ours eager, ours static graph; the newest run
with all three at two or more batch sizes) and chunked prefill time / peak memory by prompt length (ours, the newest
run with three or more lengths).

    PYTHONPATH=/path/to/matplotlib python bench/plot_e2e.py [--json bench/results/e2e_h200.json] [--out ...png]

matplotlib is not a dependency of the package: install it anywhere (e.g. pip install --target /tmp/mpl matplotlib).
"""

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = [("native", "native (Transformers + fla)"), ("ours", "ours, eager"),
         ("ours_static_graph", "ours, static cache + CUDA graph")]


def newest(runs, want):
    """The last run whose rows satisfy want(rows)."""
    for run in reversed(runs):
        if want([r for r in run["rows"] if "error" not in r]):
            return run
    raise SystemExit("no run with the rows this plot needs")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(RESULTS / "e2e_h200.json"))
    ap.add_argument("--out", default=str(RESULTS / "e2e_h200.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.load(open(args.json))["runs"]

    def decode_batches(rows):  # batches with a row for every implementation, 1,024-token prompt
        got = {(r["impl"], r["batch"]) for r in rows if r["stage"] == "decode" and r.get("prompt") == 1024}
        return [b for b in (1, 8, 64) if all((i, b) in got for i, _ in IMPLS)]

    dec = newest(runs, lambda rows: len(decode_batches(rows)) >= 2)
    lon = newest(runs, lambda rows: sum(r["stage"] == "longest" for r in rows) >= 3)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    batches = decode_batches([r for r in dec["rows"] if "error" not in r])
    rows = {(r["impl"], r["batch"]): r for r in dec["rows"] if r["stage"] == "decode" and "error" not in r}
    width = 0.27
    for k, (impl, label) in enumerate(IMPLS):
        xs = [i + (k - 1) * width for i in range(len(batches))]
        ys = [rows[(impl, b)]["tok_s"] for b in batches]
        bars = ax1.bar(xs, ys, width, label=label)
        ax1.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7)
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(batches)), [f"B={b}" for b in batches])
    ax1.set_ylabel("decode tokens/s (generate(), log scale)")
    ax1.set_title(f"Decode after a 1,024-token prompt (commit {dec['meta']['commit']})", fontsize=10)
    ax1.legend(fontsize=8, loc="upper left")

    pts = {}
    for r in lon["rows"]:
        if r["stage"] == "longest" and r.get("impl") == "ours" and "error" not in r:
            pts[r["T"]] = r  # a length run twice keeps its later row
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
    ax3.set_ylim(0, 145)
    ax3.axhline(139.8, color="gray", lw=0.8, ls=":")
    ax3.text(Ts[0], 133, "H200 memory (~140 GiB)", fontsize=7, color="gray")
    for r in lon["rows"]:
        if r["stage"] == "longest" and r.get("impl") == "native" and r.get("error") == "out of memory":
            ax3.plot([r["T"]], [139.8], "x", color="C0", ms=10, mew=2, label=f"native, one pass: OOM at {r['T']:,}")
    ax3.set_ylabel("peak GiB (torch allocator)")
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=8, loc="center left")
    ax2.set_title(f"Long-prompt prefill, bf16, B=1 (commit {lon['meta']['commit']})", fontsize=10)
    fig.suptitle("Kimi Linear 4.3B benchmark config on one NVIDIA H200 (bench/results/e2e_h200.json)", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out} (decode: {dec['meta']['commit']}, longest: {lon['meta']['commit']})")


if __name__ == "__main__":
    main()
