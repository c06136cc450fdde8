"""The KDA chunk kernels' default launch settings fit an H200: every launch that the forward and backward make at
K = V = 128 (bf16 and fp32 inputs, both gates, small and large grids) is compiled for sm_90 by Triton's own compiler,
which needs no GPU, and its shared memory must fit the 232,448 bytes one sm_90 block may use. The interpreter that
runs the kernels in CI never sees this limit: 3 stages for the backward state scan needed 294,912 bytes with fp32
inputs.

The launches are recorded, not run: each kernel object is swapped for a recorder while chunk_kda's host code runs a
forward and backward on CPU tensors; then the real kernels are compiled with the recorded arguments. The compile runs
in its own process without TRITON_INTERPRET, which would turn the kernels into interpreted functions."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SM90_SHARED_LIMIT = 232448  # bytes per block (227 KB) on H100 / H200


def record_launches():
    import torch
    from triton.runtime.jit import JITFunction

    from kimi3_kernels.kda import chunk_fwd, chunk_bwd, chunk_kda, gate

    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    swapped = [(m, name, obj) for m in (chunk_fwd, chunk_bwd, gate) for name, obj in list(vars(m).items())
               if isinstance(obj, JITFunction)]
    try:
        for m, name, obj in swapped:
            setattr(m, name, Recorder(obj))
        # H=2: the forward scan's small-grid tile; H=72: 144 programs at 64 wide, its large-grid tile. Each case
        # runs the inference forward (16-token sub-chunks; "seg": in segments of one chunk each) and the training
        # forward and backward (64-token chunks)
        one_chunk = lambda n, programs, device: [(c, c + 1) for c in range(n)] or [(0, 0)]  # noqa: E731
        auto = chunk_fwd.fwd16_segments
        for dtype, lb, H, seg in ((torch.bfloat16, -5.0, 2, False), (torch.bfloat16, None, 2, False),
                                  (torch.float32, -5.0, 2, False), (torch.float32, None, 2, False),
                                  (torch.bfloat16, -5.0, 72, False), (torch.float32, -5.0, 72, False),
                                  (torch.bfloat16, -5.0, 2, True), (torch.float32, None, 2, True)):
            chunk_fwd.fwd16_segments = one_chunk if seg else auto
            T, K = 128, 128
            xs = [torch.randn(1, T, H, K, dtype=dtype, requires_grad=True) for _ in range(4)]
            kw = dict(A_log=torch.zeros(H), dt_bias=torch.zeros(H * K), lower_bound=lb,
                      initial_state=torch.zeros(1, H, K, K), output_final_state=True)
            beta = torch.randn(1, T, H, dtype=dtype)
            with torch.no_grad():
                chunk_kda(*(x.detach() for x in xs), beta, **kw)
            o, s = chunk_kda(*xs, beta, **kw)
            (o.float().sum() + s.sum()).backward()
    finally:
        chunk_fwd.fwd16_segments = auto
        for m, name, obj in swapped:
            setattr(m, name, obj)
    return launches


def compile_sm90(fn, args, kwargs):
    """Shared memory in bytes of one recorded launch, compiled for sm_90."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
           torch.int64: "*i64", torch.uint8: "*u8", torch.int8: "*i8"}
    vals = dict(zip(fn.arg_names, args), **kwargs)
    options = dict(num_warps=vals.pop("num_warps", 4), num_stages=vals.pop("num_stages", 3))
    if "maxnreg" in vals:  # a launch's register cap (a fourth field in kimi3_kernels.kda.configs.LAUNCH) changes what ptxas allocates
        options["maxnreg"] = vals.pop("maxnreg")
    sig, consts, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = vals[name]
        if param.is_constexpr or v is None:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = ptr[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        else:
            sig[name] = "i32" if isinstance(v, int) else "fp32"
    key = (fn.__name__, tuple(sig.items()), tuple((k, repr(c)) for k, c in consts.items()), tuple(options.items()))
    compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return key, compiled.metadata.shared


def main():
    seen = {}
    for fn, args, kwargs in record_launches():
        key, shared = compile_sm90(fn, args, kwargs)
        seen.setdefault(key, shared)
    for (name, sig, _, options), shared in seen.items():
        print(f"{name} {dict(sig).get('W', dict(sig).get('q', ''))} {dict(options)} shared={shared}")
    print("kernels", ",".join(sorted({key[0] for key in seen})))


def test_default_launches_fit_sm90_shared_memory():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "..", "..", "kernels"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if " shared=" in line]
    over = [r for r in rows if int(r.rsplit("shared=", 1)[1]) > SM90_SHARED_LIMIT]
    assert not over, "\n".join(over)
    kernels = proc.stdout.split("kernels ", 1)[1].split()[0].split(",")
    assert set(kernels) >= {"_gate_fwd_kernel", "_norm_fwd_kernel", "_diag_fwd_kernel", "_diag_inv_kernel",
                            "_intra_fwd_kernel", "_wu_fwd_kernel", "_state_fwd_kernel", "_output_fwd_kernel",
                            "_state_bwd_kernel", "_main_bwd_kernel", "_intra_bwd_kernel", "_prep_bwd_kernel",
                            "_sub_fwd_kernel", "_rec_fwd_kernel"}, kernels
    # both scan tiles (small and large grids), in both dtypes
    assert sum("_state_fwd_kernel" in r for r in rows) >= 4, rows
    assert sum("_state_bwd_kernel" in r for r in rows) >= 4, rows  # the backward scan's two tiles too
    # the sub-chunk kernel compiled under its default register cap, as it launches
    sub = [r for r in rows if r.startswith("_sub_fwd_kernel ")]
    assert sub and all("'maxnreg': 160" in r for r in sub), sub


if __name__ == "__main__":
    main()
