"""Where an eager decode step's host (CPU) time goes in the whole model (K3-shaped with MXFP4 experts, or the
4.3B Kimi Linear config with --model kimi_linear; B=1):

    python bench/decode_host.py --out DIR [--tiny] [--model k3|kimi_linear]

The eager step (one token, dynamic cache; a CUDA event pair around each call) and its host time (calls queued
without a synchronisation), then a cProfile of --steps eager steps: the functions by own and by cumulative time, to
DIR/decode_host_profile.txt. What an eager generate() step costs beyond the GPU's work is mostly this host time
(e2e.py's decode rows); the static-cache graph replays it without Python."""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from transformers_kimi3.benchmark import (BENCH_CONFIG, K3_BENCH_CONFIG, K3_TINY_CONFIG, TINY_CONFIG,  # noqa: E402
                                          build_k3, build_pair)
from transformers_kimi3.cache import Kimi3Cache  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="a toy config (CPU smoke run)")
    ap.add_argument("--model", default="k3", choices=["k3", "kimi_linear"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model == "k3":
        m = build_k3(K3_TINY_CONFIG if args.tiny else K3_BENCH_CONFIG, device, dtype)
    else:
        m = build_pair(TINY_CONFIG if args.tiny else BENCH_CONFIG, device, dtype)[1]
    ids = torch.randint(3, m.config.vocab_size, (1, args.prompt), device=device)
    rows = []
    with torch.no_grad():
        cache = Kimi3Cache(m.config)
        tok = m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        step = lambda: m(input_ids=tok, past_key_values=cache)  # noqa: E731
        for _ in range(5):
            step()
        sync()
        for _ in range(3):  # rounds: the host is noisy
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            host = (time.perf_counter() - t0) / args.steps
            sync()
            wall = (time.perf_counter() - t0) / args.steps
            rows.append(dict(part="eager_step", model=args.model,
                             fused_linears=os.environ.get("KIMI3_FUSED_LINEARS", "1"), host_ms=round(host * 1e3, 3), wall_ms=round(wall * 1e3, 3),
                             commit=os.environ.get("GIT_COMMIT", "unknown"),
                             device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu"))
            print(json.dumps(rows[-1]), flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        sync()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(70)
    Path(args.out, "decode_host_profile.txt").write_text(s.getvalue())
    with open(Path(args.out, "decode_host.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
