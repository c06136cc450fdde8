"""W4A8 on the GPU (FP8 tensor cores, sm_89+): the MXFP8 quantiser gives the emulation's codes and scales bit for
bit; the FP8 grouped GEMM equals the fp32 reference on the dequantised activations to the precision of the tensor
cores' FP8 sums; the packed experts with `activation_format="mxfp8"` equal their emulated path, and the bundled
model's logits with MXFP8 activations stay close to the bf16-activation model's."""

import os

import pytest
import torch

from kimi3_testing import ROOT
from transformers_kimi3 import Kimi3ForConditionalGeneration, kernels, mxfp8
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

pytestmark = pytest.mark.gpu


def _ops():
    ops = kernels.mxfp4_ops()
    if ops is None or not torch.cuda.is_available() or not ops.w4a8_available("cuda"):
        pytest.skip("needs Triton and a GPU with FP8 tensor cores (sm_89+)")
    return ops


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_quantiser_equals_emulation_bit_for_bit(record):
    ops = _ops()
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(257, 3584, generator=gen) * torch.logspace(-30, 30, 3584)[None, :]
    wide[0, :32] = -0.0
    wide[1, :64] = torch.tensor([448.0, 464.0, 480.0, 1.0625, 1.1875, 2 ** -9, 2 ** -10, 3 * 2 ** -10] * 8)
    wide[2, 32:64] = 2.0 ** -130
    for name, x in {"fp32": wide, "bf16": (wide * 1e-20).bfloat16(), "fp16": torch.randn(64, 3072).half()}.items():
        q, s = ops.quantize_mxfp8(x.cuda())
        qe, se = mxfp8.quantize_mxfp8(x)
        codes = float((q.view(torch.uint8).cpu() != qe.view(torch.uint8)).sum())
        scales = float((s.cpu() != se).sum())
        record(f"MXFP8 quantiser, {name}: codes / scales differing from the emulation", codes + scales, 0.5)


@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_w4a8_gemm_equals_reference(tokens, record):
    ops = _ops()
    gen = torch.Generator().manual_seed(1)
    E, D, I, k = 32, 512, 384, 4
    w1 = torch.randint(0, 256, (E, I, D // 2), dtype=torch.uint8, generator=gen).cuda()
    s1 = torch.randint(118, 128, (E, I, D // 32), dtype=torch.uint8, generator=gen).cuda()
    w3 = torch.randint(0, 256, (E, I, D // 2), dtype=torch.uint8, generator=gen).cuda()
    s3 = torch.randint(118, 128, (E, I, D // 32), dtype=torch.uint8, generator=gen).cuda()
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).cuda()
    flat = idx.flatten()
    sorted_e, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(E + 1, device="cuda")).to(torch.int32)
    x = torch.randn(tokens, D, generator=gen).bfloat16().cuda()
    q, s = ops.quantize_mxfp8(x)
    xd = mxfp8.dequantize_mxfp8(q, s)
    kw = dict(a_rows=(order // k).to(torch.int32), c_rows=order.to(torch.int32), num_c_rows=flat.numel(),
              b_packed=w3, b_scale=s3, dual="out", act="situ", act_params=(4.0, 25.0))
    got = ops.mxfp4_grouped_gemm(q, w1, s1, offs, a_scale=s, **kw)
    want = ops.mxfp4_grouped_gemm_ref(xd, w1, s1, offs, **kw)
    # exact products; each 32-column block summed by one FP8 MMA (Hopper keeps about 14 bits when it aligns the
    # products to the largest, DeepSeek-V3 report), then in fp32: bound 2e-4
    record(f"W4A8 GEMM gate+up with SiTU, {tokens} tokens, vs fp32 reference", _rel(got, want), 2e-4)
    if tokens <= 2:
        return
    ids = flat.to(torch.int32)
    kw1 = dict(expert_ids=ids, a_row_div=k)
    got = ops.mxfp4_grouped_gemm(q, w1, s1, None, a_scale=s, **kw1)
    want = ops.mxfp4_grouped_gemm_ref(xd, w1, s1, None, **kw1)
    record(f"W4A8 GEMM one route per program, {tokens} tokens, vs fp32 reference", _rel(got, want), 2e-4)


def test_bundled_model_with_mxfp8_activations(record):
    _ops()
    folder = os.path.join(ROOT, "assets", "kimi-k3-mini")
    ids = torch.randint(3, 1000, (2, 96), generator=torch.Generator().manual_seed(2)).cuda()
    logits = {}
    for fmt in ("bf16", "mxfp8"):
        model = Kimi3ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16,
                                                              moe_activation_format=fmt).cuda().eval()
        with torch.no_grad():
            logits[fmt] = model(input_ids=ids).logits.float()
            if fmt == "mxfp8":  # the W4A8 kernels against the emulated experts of the same model
                experts = [m for m in model.modules() if isinstance(m, PackedMXFP4Experts)]
                assert experts and all(m._kernels(ids.new_zeros(1, 1, dtype=torch.bfloat16)) for m in experts)
                for m in experts:
                    m._kernels = lambda x, grad=False: None
                logits["emulated"] = model(input_ids=ids).logits.float()
        del model
    # the same MXFP8 codes; bf16 rounding of the GLU output and fp32 sums in another order move a few codes by
    # one E4M3 step; measured against a bf16 model's own bf16-vs-fp32 distance (~1e-2 at the logits): bound 3e-2
    record("mini model, MXFP8 activations: W4A8 kernels vs emulated path (logits)",
           _rel(logits["mxfp8"], logits["emulated"]), 3e-2)
    top1 = float((logits["mxfp8"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean())
    record("mini model: share of next tokens that MXFP8 activations change (vs bf16 activations)", 1 - top1, 0.1)
