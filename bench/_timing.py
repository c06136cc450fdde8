"""Timing helpers shared by the bench scripts: CUDA-graph capture and replay timing, and a JSONL writer."""
import json
import os
import time

import torch


def capture(fn):
    """fn captured in a CUDA graph, after three warm-up calls on a side stream (Triton compiles, cuBLAS picks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_us(fn, rep=200):
    """Microseconds per call of fn captured in a CUDA graph, from `rep` back-to-back replays between two events (the
    per-call events of bench/moe.py would add the host's launch latency to a call this short)."""
    g = capture(fn)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(rep):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / rep * 1e3


def host_us(fn, calls=100):
    """Host microseconds per eager call: calls queued back to back without a synchronisation inside (where the
    GPU work of a call is shorter than its launch path's Python, the GPU idles in eager mode)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t
    torch.cuda.synchronize()
    return t / calls * 1e6


def write_jsonl(out, name, rows):
    """A meta line (GPU, torch, GIT_COMMIT) and then the rows, one JSON object per line."""
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=os.environ.get("GIT_COMMIT"))
    with open(os.path.join(out, name), "w") as f:
        for r in [meta] + rows:
            f.write(json.dumps(r) + "\n")
