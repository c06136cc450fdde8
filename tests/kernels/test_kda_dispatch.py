"""The KDA backend choice: what runs by default, what an explicit request does when it cannot run (an error, never a
silent fallback), and where the mixed "fla_chunk" backend sends each call."""

import pytest
import torch

from transformers_kimi3 import kernels


def test_default_on_cpu_is_the_reference_and_is_reported(monkeypatch):
    monkeypatch.delenv("KIMI3_KDA_BACKEND", raising=False)
    assert kernels.resolve_kda_backend(torch.device("cpu"), announce=False) == "torch"
    status = kernels.kernel_status("cpu")
    assert status["kda"]["backend"] == "torch"
    assert status["kda"]["available"] == {"triton": False, "fla": False, "torch": True}
    assert status["moe"]["mxfp4_experts"] == "torch-per-expert"


@pytest.mark.parametrize("requested", ["triton", "fla", "fla_chunk"])
def test_a_backend_that_cannot_run_is_an_error(requested, monkeypatch):
    monkeypatch.delenv("KIMI3_KDA_BACKEND", raising=False)
    with pytest.raises(RuntimeError, match=f"'{requested}' was requested"):
        kernels.resolve_kda_backend(torch.device("cpu"), requested, announce=False)
    monkeypatch.setenv("KIMI3_KDA_BACKEND", requested)  # the environment variable asks the same way
    with pytest.raises(RuntimeError, match=f"'{requested}' was requested"):
        kernels.resolve_kda_backend(torch.device("cpu"), announce=False)


def test_unknown_backend_is_refused_naming_where_it_came_from(monkeypatch):
    monkeypatch.delenv("KIMI3_KDA_BACKEND", raising=False)
    with pytest.raises(ValueError, match="kda_backend='cuda' is not a KDA backend"):
        kernels.resolve_kda_backend(torch.device("cpu"), "cuda", announce=False)
    monkeypatch.setenv("KIMI3_KDA_BACKEND", "tritn")
    with pytest.raises(ValueError, match="KIMI3_KDA_BACKEND='tritn' is not a KDA backend"):
        kernels.resolve_kda_backend(torch.device("cpu"), announce=False)


def test_fla_chunk_sends_prefill_to_fla_and_decode_to_our_kernel(monkeypatch):
    # both libraries stubbed (neither runs on CPU): the mixed backend must route chunked calls to fla with fla's
    # gate/beta-in-kernel flags, and recurrent calls to kimi3_kernels with our arguments untouched
    calls = []

    class Ours:
        @staticmethod
        def fused_recurrent_kda(q, k, v, g, beta, **kw):
            calls.append(("ours_recurrent", sorted(kw)))
            return q, None

        @staticmethod
        def chunk_kda(q, k, v, g, beta, **kw):
            calls.append(("ours_chunk", sorted(kw)))
            return q, None

    def fla_chunk(q, k, v, g, beta, **kw):
        calls.append(("fla_chunk", kw["use_gate_in_kernel"], kw["use_beta_sigmoid_in_kernel"], kw["safe_gate"]))
        return q, None

    def fla_recurrent(*a, **kw):
        calls.append(("fla_recurrent",))
        return a[0], None

    monkeypatch.delenv("KIMI3_KDA_BACKEND", raising=False)
    monkeypatch.setattr(kernels, "kda_ops", Ours)
    monkeypatch.setitem(kernels._FLA, "ops", (fla_chunk, fla_recurrent))
    monkeypatch.setattr(torch.cuda, "device", lambda d: torch.device("cpu"))  # a no-op context on CPU tensors
    cuda = torch.device("cuda")
    assert kernels.resolve_kda_backend(cuda, "fla_chunk", announce=False) == "fla_chunk"
    assert kernels.resolve_kda_backend(cuda, None, announce=False) == "triton"  # the default is unchanged
    x = torch.zeros(1, 2, 1, 4)
    kw = dict(A_log=torch.zeros(1), dt_bias=torch.zeros(4), lower_bound=-5.0, initial_state=None)
    kernels.kda_chunk(x, x, x, x, x[..., 0], "fla_chunk", **kw)
    kernels.kda_recurrent(x, x, x, x, x[..., 0], "fla_chunk", **kw)
    kernels.kda_chunk(x, x, x, x, x[..., 0], "triton", **kw)
    assert calls == [("fla_chunk", True, True, True),
                     ("ours_recurrent", ["A_log", "dt_bias", "initial_state", "lower_bound"]),
                     ("ours_chunk", ["A_log", "dt_bias", "initial_state", "lower_bound"])]


def test_inference_kernel_switch(monkeypatch):
    """KIMI3_INFERENCE_KERNELS=0 turns the one-launch fast paths off (the AttnRes mix here; the MoE ones in
    test_moe.py) and kernel_status says so."""
    import transformers_kimi3
    from transformers_kimi3 import attn_res

    monkeypatch.setattr(kernels, "kernel_device", lambda t: True)  # as if the CPU tensors were on a kernel device
    monkeypatch.setattr(kernels, "attn_res_ops", object())
    proj, norm = attn_res.Kimi3AttnResProj(8), attn_res.Kimi3AttnResNorm(8)
    bank = torch.zeros(1, 2, 3, 8)
    with torch.no_grad():
        assert attn_res.kernel_used(bank, proj, norm)
        monkeypatch.setenv("KIMI3_INFERENCE_KERNELS", "0")
        assert not attn_res.kernel_used(bank, proj, norm)
    assert not attn_res.kernel_used(bank, proj, norm)  # autograd recording keeps the PyTorch path too
    assert transformers_kimi3.kernel_status("cpu")["inference_kernels"]["enabled"] is False
