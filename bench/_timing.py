"""The timing and recording helpers every bench script shares.

- `cuda_ms(fn)`: median of CUDA-event-timed calls (a call's own GPU time plus whatever host time it waits for);
- `graph_ms(fn)` / `graph_us(fn)`: the GPU time of `fn` captured in a CUDA graph and replayed back to back (no host
  launch cost: what a short call costs inside a captured decode step);
- `host_us(fn)`: host time per eager call, queued without synchronisation;
- `meta()`: the GPU, library versions and the label of the tree that ran (`--label`, else `git describe`);
- `Results`: a JSON file rewritten after every row, so a run cut short keeps what it measured; with
  `keep_runs=True` the file's earlier runs stay beside this one (`{"runs": [{"meta", "rows"}, ...]}`), since one
  script's sections are often run in separate calls; `load_runs` reads either form.
"""
import json
import os
import subprocess
import time

import torch


def cuda_ms(fn, warm=2, rep=10):
    """Median milliseconds of `rep` calls, each between two CUDA events, after `warm` untimed calls."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def wall_ms(fn, device, warm=1, rep=3):
    """Median wall milliseconds of `rep` synchronised calls: for whole-model calls, and on the CPU."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warm):
        fn()
    times = []
    for _ in range(rep):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


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
    """Microseconds per call of fn captured in a CUDA graph, from `rep` back-to-back replays between two events
    (per-call events would add the host's launch latency to a call this short)."""
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


def graph_ms(fn, rep=200):
    return graph_us(fn, rep) / 1e3


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


def rel(a, b):
    """max |a - b| / max |b|, in fp64: the relative error every table in docs/ reports."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def label(explicit=None):
    """What ran: an explicit label, else `git describe` of the checkout (a device copy may have no .git)."""
    if explicit:
        return explicit
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def meta(tree_label=None, **extra):
    """The GPU, library versions and the tree's label, stored at the top of every results file."""
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "tree": label(tree_label)}
    for name in ("triton", "transformers", "fla"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - optional packages; fla raises more than ImportError without a GPU
            info[name] = None
    info.update(extra)
    return info


def load_runs(path):
    """The runs of a results file: `{"runs": [...]}`, or one `{"meta", "rows"}`; [] if there is no file."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        res = json.load(f)
    return res["runs"] if "runs" in res else [res]


class Results:
    """This run's {"meta": ..., "rows": [...]}, written to `path` (None: printed only) after every row."""

    def __init__(self, path, keep_runs=False, **meta_fields):
        self.path, self.meta, self.rows = path, meta(**meta_fields), []
        self.earlier = load_runs(path) if keep_runs else None

    def add(self, **row):
        self.rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        self.save()

    def save(self):
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        run = {"meta": self.meta, "rows": self.rows}
        with open(self.path, "w") as f:
            json.dump(run if self.earlier is None else {"runs": self.earlier + [run]}, f, indent=1, default=str)


def write_jsonl(out, name, rows):
    """A meta line and then the rows, one JSON object per line."""
    with open(os.path.join(out, name), "w") as f:
        for r in [meta()] + rows:
            f.write(json.dumps(r) + "\n")
