"""kimi3_kernels._launch: the direct launch path's plumbing on CPU with a stand-in kernel (the real launcher needs a
GPU: tests/test_mxfp4_wgmma.py compares direct and Triton launches bit for bit on an H200)."""

import inspect
import os
from types import SimpleNamespace

import pytest
import torch

from kimi3_kernels import _launch


class FakeKernel:
    """A compiled kernel: records what its launcher receives."""

    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def run(self, *a):
        if self.fail:
            raise TypeError("launcher of another Triton")
        self.calls.append(a)


class FakeJIT:
    """fn[grid](*args, **kw) as Triton's JITFunction: records the call, returns the compiled kernel."""

    def __init__(self, kernel):
        empty = inspect.Parameter.empty
        self.params = [SimpleNamespace(name=n, is_constexpr=c, default=d) for n, c, d in
                       (("x", False, empty), ("n", False, empty), ("BLOCK", True, empty), ("FLAG", True, 7))]
        self.kernel, self.jit_calls = kernel, []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.jit_calls.append((grid, args, kw))
            return self.kernel
        return run


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(_launch, "_on_gpu", lambda args: True)
    monkeypatch.setattr(_launch, "_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda device: 1234)
    monkeypatch.setattr(_launch, "_switched_on", lambda: not _launch._FAILED)
    monkeypatch.setattr(_launch, "_COMPILED", {})
    monkeypatch.setattr(_launch, "_FAILED", [])


def test_direct_after_first_launch(gpu):
    k = FakeKernel()
    fn = FakeJIT(k)
    x = torch.zeros(64)
    _launch.launch(fn, (3,), (x, 32), BLOCK=16, num_warps=4)
    assert fn.jit_calls == [((3,), (x, 32), {"BLOCK": 16, "num_warps": 4})] and k.calls == []
    _launch.launch(fn, (5, 2), (x, 32), BLOCK=16, num_warps=4)
    assert len(fn.jit_calls) == 1
    # grid padded to 3-D, the stream, the handles, no metadata or hooks, then every parameter in signature order
    # (the constexprs after the runtime arguments, FLAG at its default; num_warps is not a parameter)
    assert k.calls == [(5, 2, 1, 1234, "fn-handle", "meta", None, None, None, x, 32, 16, 7)]
    assert _launch._DIRECT[0] >= 1


@pytest.mark.parametrize("change", ["unaligned", "dtype", "int_one", "int_mod16", "int_64bit", "constexpr",
                                    "bool_constexpr", "option"])
def test_new_specialisation_goes_through_triton(gpu, change):
    k = FakeKernel()
    fn = FakeJIT(k)
    x = torch.zeros(64)
    _launch.launch(fn, (1,), (x, 32), BLOCK=16, num_warps=4)
    args, kw = (x, 32), dict(BLOCK=16, num_warps=4)
    if change == "unaligned":
        args = (x[1:], 32)
    elif change == "dtype":
        args = (x.double(), 32)
    elif change == "int_one":
        args = (x, 1)
    elif change == "int_mod16":
        args = (x, 33)
    elif change == "int_64bit":
        args = (x, 1 << 40)
    elif change == "constexpr":
        kw["BLOCK"] = 32
    elif change == "bool_constexpr":  # True == 16 is False, but True == 1: compare with BLOCK=1 first
        _launch.launch(fn, (1,), args, BLOCK=1, num_warps=4)
        fn.jit_calls.pop()
        kw["BLOCK"] = True
    else:
        kw["num_warps"] = 8
    _launch.launch(fn, (1,), args, **kw)
    assert len(fn.jit_calls) == 2 and k.calls == []
    _launch.launch(fn, (1,), args, **kw)  # that specialisation now cached
    assert len(fn.jit_calls) == 2 and len(k.calls) == 1


def test_bound_launcher_shares_launchs_cache(gpu):
    # a launch plan's Launcher: its constexprs' key is built once; it and launch() with the same constexprs find
    # each other's compiled kernels, and a new specialisation of the arguments still goes through Triton
    k = FakeKernel()
    fn = FakeJIT(k)
    x = torch.zeros(64)
    bound = _launch.Launcher(fn, BLOCK=16, num_warps=4)
    bound((3,), (x, 32))
    _launch.launch(fn, (2,), (x, 32), BLOCK=16, num_warps=4)
    bound((5, 2), (x, 32))
    assert len(fn.jit_calls) == 1
    assert k.calls[-1] == (5, 2, 1, 1234, "fn-handle", "meta", None, None, None, x, 32, 16, 7) and len(k.calls) == 2
    bound((1,), (x[1:], 32))
    assert len(fn.jit_calls) == 2
    assert _launch.Launcher(fn, BLOCK=16, num_warps=4)._ckey == bound._ckey
    assert len({_launch.Launcher(fn, BLOCK=b, num_warps=4)._ckey for b in (16, 1, True, 32)}) == 4


def test_failed_direct_launch_falls_back_for_good(gpu, caplog):
    k = FakeKernel(fail=True)
    fn = FakeJIT(k)
    x = torch.zeros(64)
    _launch.launch(fn, (1,), (x, 32), BLOCK=16)
    with caplog.at_level("WARNING"):
        _launch.launch(fn, (1,), (x, 32), BLOCK=16)  # the launcher raises: Triton launches this one
    assert len(fn.jit_calls) == 2 and "launching through Triton" in caplog.text
    assert _launch._FAILED and not _launch._COMPILED
    _launch.launch(fn, (1,), (x, 32), BLOCK=16)
    assert len(fn.jit_calls) == 3
    assert _launch.status()["direct_launch_error"].startswith("TypeError")


def test_signature_it_cannot_order_is_never_cached(gpu):
    k = FakeKernel()
    fn = FakeJIT(k)
    fn.params[3].default = inspect.Parameter.empty  # FLAG has no default and is not given
    x = torch.zeros(64)
    for _ in range(3):
        _launch.launch(fn, (1,), (x, 32), BLOCK=16)
    assert len(fn.jit_calls) == 3 and k.calls == []


def test_off_switches(monkeypatch):
    monkeypatch.setattr(_launch, "_FAILED", [])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    allowed = _launch.enabled()
    with _launch.direct_launch(False):
        assert not _launch.enabled()
    assert _launch.enabled() == allowed  # restored on exit
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _launch.enabled()
    # CPU tensors never take the direct path
    assert not _launch._on_gpu((torch.zeros(2), 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the compiled kernels' launchers")
def test_decode_kernels_direct_match_triton_on_gpu(monkeypatch):
    """The eager decode step's other kernels (router, GLU, expert GEMVs, route combines, short convs, gated norm,
    recurrent KDA, attention-residual mix) give the same bits launched directly as through Triton, and the direct
    path really runs."""
    pytest.importorskip("triton")
    from kimi3_kernels import attn_res, moe_decode
    from kimi3_kernels.kda import layer_ops, recurrent

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def rn(*s, dtype=torch.bfloat16):
        return torch.randn(*s, device=dev, generator=gen).to(dtype)

    T, D, E, I, k, H, Kd = 2, 256, 64, 128, 4, 4, 64
    x, wr, bias = rn(T, D), rn(E, D), rn(E, dtype=torch.float32)
    w1, w3, w2 = rn(E, I, D), rn(E, I, D), rn(E, D, I)
    idx = torch.randint(0, E, (T, k), device=dev, generator=gen)
    tw = torch.rand(T, k, device=dev, generator=gen)
    states0 = [rn(1, D, 4) for _ in range(3)]
    convw = [rn(D, 1, 4) for _ in range(3)]
    q, kk, v, g = (rn(1, 1, H, Kd) for _ in range(4))
    beta = rn(1, 1, H)
    A_log, dt_bias = rn(H, dtype=torch.float32), rn(H * Kd, dtype=torch.float32)
    h0 = rn(1, H, Kd, Kd, dtype=torch.float32)
    bank = rn(1, T, 3, D)

    def step():
        states = [s.clone() for s in states0]
        ht = h0.clone()
        out = list(moe_decode.route_topk(x, wr, bias, k, True, 2.5))
        out.append(moe_decode.glu_mul(x, x, situ_beta=4.0, linear_beta=25.0))
        out.append(moe_decode.expert_gemv(x, w1, w3, w2, idx, tw))
        out.append(moe_decode.mlp_gemv(x[:1], w1[0], w3[0], w2[0]))
        out += list(layer_ops.short_conv_update([x[None, :1]] * 3, states, convw)) + states
        out.append(layer_ops.gated_rms_norm(x, x, x[0], 1e-6))
        o, _ = recurrent.fused_recurrent_kda(q, kk, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                                             initial_state=ht, inplace_final_state=True)
        out += [o, ht, attn_res.attn_res_mix(bank, x[None], x[0], x[1], 1e-6)]
        return out

    with _launch.direct_launch(False):
        ref = step()
    before = _launch._DIRECT[0]
    runs = [step() for _ in range(3)]
    torch.cuda.synchronize()
    assert _launch._DIRECT[0] >= before + 20 and not _launch._FAILED, (before, _launch._DIRECT[0])
    for out in runs:
        for i, (a, b) in enumerate(zip(out, ref)):
            assert torch.equal(a, b), i


def test_launch_hooks_keep_tritons_path():
    """Profilers set Triton's launch hooks: None or an empty HookChain means none is set."""
    assert not _launch._hook_set(None)
    assert not _launch._hook_set(SimpleNamespace(calls=[]))
    assert _launch._hook_set(SimpleNamespace(calls=[print]))
    assert _launch._hook_set(print)
    if _launch._knobs is not None:  # this Triton as installed: no hooks, so direct launches are allowed
        assert not _launch._hook_set(_launch._knobs.runtime.launch_enter_hook)
