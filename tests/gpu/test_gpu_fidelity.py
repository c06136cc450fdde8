"""An fp32 model on the GPU computes what it computes on the CPU, and a bf16 model stays within stated bounds of it.

Two layouts: K3 (bounded gate -3, 3 KDA heads of dim 16, hidden 192, 7 layers, AttnRes blocks of 2, packed MXFP4
experts) and Kimi Linear (softplus gate, SiLU experts in bf16 weights, no AttnRes). Every path a user reaches: a
left-padded batch, packed documents with gradients, chunked prefill, static-cache decode and generation, each KDA
backend and the fused inference kernels on and off. The CPU runs the PyTorch paths in fp32: the reference.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from kimi3_testing import ORACLE, ORACLE_A, rel_err, tiny_model

FP32 = 2e-5  # fp32 GPU vs fp32 CPU, relative to the largest reference value (3xTF32 matmuls: ~1e-6)
FP32_GRAD = 1e-4
# bf16 GPU model vs fp32 CPU model, floors of the bounds. "component": a module alone on bf16 inputs, whose bound is
# 3x the CPU bf16 copy's error on the same inputs where that is larger (one bf16 rounding is 2^-9 relative; the CPU
# modules measure 5e-3 to 1.1e-2; a GPU kernel may keep an intermediate in bf16 that the CPU keeps in fp32).
# "logits": the whole model, bound 2x the CPU bf16 copy's where larger (errors compound over layers); "rerouted":
# the share of tokens whose top-k expert set differs in a MoE layer
BF16 = {"logits": 6e-2, "component": 2e-2, "component_factor": 3, "rerouted": 0.25}


def k3_model():
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    m = tiny_model(seed=7, hidden_size=192, num_hidden_layers=7, attn_res_block_size=2, vocab_size=128,
                   moe_intermediate_size=64, routed_expert_hidden_size=64,
                   linear_attn_config=dict(num_heads=3, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-3.0,
                                           use_full_rank_gate=True, kda_layers=[1, 2, 3, 5, 6],
                                           full_attn_layers=[4, 7]))
    for layer in m.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            moe.experts = PackedMXFP4Experts.from_experts(moe.experts)
    return m.eval()


def kimi_linear_model():
    from transformers_kimi3 import Kimi3ForCausalLM, Kimi3TextConfig

    torch.manual_seed(11)
    cfg = Kimi3TextConfig(vocab_size=128, hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                          num_hidden_layers=5, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32,
                          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8,
                          num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.0,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          linear_attn_config=dict(num_heads=2, head_dim=64, short_conv_kernel_size=4,
                                                  kda_layers=[1, 2, 4], full_attn_layers=[3, 5]))
    m = Kimi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1, 1)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
    return m


LAYOUTS = {"k3": k3_model, "kimi_linear": kimi_linear_model}
_CACHE = {}


def cpu_model(layout):
    if layout not in _CACHE:
        _CACHE[layout] = LAYOUTS[layout]()
    return _CACHE[layout]


def gpu_model(layout, dtype=torch.float32, **config):
    m = copy.deepcopy(cpu_model(layout))
    for k, v in config.items():
        setattr(m.config, k, v)
        for mod in m.modules():
            if k == "kda_backend" and hasattr(mod, "requested_backend"):
                mod.requested_backend = v
    return m.to("cuda", dtype)


def fp32_bound(layout, own=None):
    """The fp32 bound for `layout`'s logits: FP32, or 3x the CPU fp32 model's own distance from its fp64 copy (`own`,
    measured on the test's input; by default on the left-padded batch) where that is larger. Composition can amplify
    rounding (the K3 test model's fp32 CPU logits are ~7e-5 from fp64 while each of its modules alone is within 1e-6),
    and the GPU cannot be held closer to the CPU than the CPU is to fp64."""
    if own is None:
        key = ("own", layout)
        if key not in _CACHE:
            ids, mask = padded_batch(cpu_model(layout).config.vocab_size)
            fp64 = copy.deepcopy(cpu_model(layout)).double()
            _CACHE[key] = valid_rel(logits(cpu_model(layout), ids, mask), logits(fp64, ids, mask).float(), mask)
        own = _CACHE[key]
    return max(FP32, 3 * own)


def keep(store, key, value):
    """Forward-hook body: record the first value per key. Returns None, so the hooked module's output stays its own
    (a hook that returns a value replaces the output)."""
    store.setdefault(key, value)


def padded_batch(vocab, T=150, pad=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


def logits(model, ids, mask, **kw):
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev) if mask is not None else None, **kw)
    return out.logits.float().cpu()


def valid_rel(a, b, mask):
    v = mask.bool()
    return rel_err(a[v], b[v])


# fla's chunked KDA sums in another order and in bf16 tensor-core steps: 0.045 from the fp32 CPU logits on the Kimi
# Linear layout (H100)
FLA = 0.1
# fla 0.5.2's bounded-gate path (safe_gate) on the K3 test model (3 heads of dim 16): 1.2 relative on an H100, while
# at K3's head dim 128 it is within 2e-3 of the reference (bench/kda.py --sections check);
# test_fla_bounded_gate_head_dims localises it (fla's kernel alone at head dims 16 / 64 / 128)
FLA_K3 = pytest.mark.xfail(strict=True, reason="fla 0.5.2's bounded gate at head dim 16: 1.2 relative on an H100")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend,fused", [("triton", True), ("triton", False), ("torch", True),
                                           ("fla_chunk", True)])
def test_left_padded_batch(layout, backend, fused, record, monkeypatch, request):
    if backend == "fla_chunk":
        pytest.importorskip("fla")
        if layout == "k3":
            request.applymarker(FLA_K3)
    if not fused:
        monkeypatch.setenv("KIMI3_INFERENCE_KERNELS", "0")
    ids, mask = padded_batch(cpu_model(layout).config.vocab_size)
    want = logits(cpu_model(layout), ids, mask)
    got = logits(gpu_model(layout, kda_backend=backend), ids, mask)
    bound = fp32_bound(layout) if backend != "fla_chunk" else FLA
    record(f"{layout} left-padded logits, kda_backend={backend}, fused={fused}", valid_rel(got, want, mask), bound)


@pytest.mark.parametrize("K", [16, 64, 128])
def test_fla_bounded_gate_head_dims(K, record):
    """fla's chunked KDA alone with the K3 gate (lower bound -3, gate computed in its kernel, safe_gate) against our
    PyTorch reference on random inputs of 3 heads: says whether the K3 test model's fla failure is fla's kernel at that
    head dim (then K=16 fails here too) or the way the model calls it."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    from kimi3_kernels.kda import naive_chunk_kda

    g = torch.Generator().manual_seed(K)
    T, H = 150, 3
    q, k, v, f = (torch.randn(1, T, H, K, generator=g) for _ in range(4))
    beta = torch.randn(1, T, H, generator=g)
    A_log, dt_bias = torch.rand(H, generator=g) * 2 - 1, torch.randn(H * K, generator=g) * 0.3
    want, _ = naive_chunk_kda(q, k, v, f, beta, A_log=A_log,
                              dt_bias=dt_bias, lower_bound=-3.0)
    got, _ = fla_kda.chunk_kda(*(t.cuda() for t in (q, k, v, f, beta)), A_log=A_log.cuda(), dt_bias=dt_bias.cuda(),
                               lower_bound=-3.0, safe_gate=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
    record(f"fla chunk_kda, bounded gate -3, head dim {K}, vs the PyTorch reference", rel_err(got.double().cpu(), want), FLA)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_documents_with_gradients(layout, record):
    """Two documents per row (position_ids restart), forward and backward: logits and every parameter gradient."""
    cpu = copy.deepcopy(cpu_model(layout)).train()
    gpu = gpu_model(layout).train()
    ids = torch.randint(3, cpu.config.vocab_size, (2, 140), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(60), torch.arange(80)])[None].repeat(2, 1)
    outs = []
    for m in (cpu, gpu):
        dev = next(m.parameters()).device
        out = m(input_ids=ids.to(dev), position_ids=pos.to(dev), labels=ids.to(dev))
        out.loss.backward()
        grads = {n: p.grad.float().cpu() for n, p in m.named_parameters() if p.grad is not None}
        outs.append((out.logits.detach().float().cpu(), grads))
    (lc, gc), (lg, gg) = outs
    with torch.no_grad():  # the same forward in fp64: the bound's own rounding distance on these packed documents
        l64 = copy.deepcopy(cpu_model(layout)).double().train()(input_ids=ids, position_ids=pos).logits
    bound = fp32_bound(layout, own=rel_err(lc, l64.float()))
    record(f"{layout} packed documents logits", rel_err(lg, lc), bound)
    assert set(gc) == set(gg) and gc
    worst = max(gc, key=lambda n: rel_err(gg[n], gc[n]) if gc[n].abs().max() > 0 else 0.0)
    record(f"{layout} packed documents gradients (worst: {worst})", rel_err(gg[worst], gc[worst]),
           max(FP32_GRAD, 5 * bound))  # the backward runs the composition a second time


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chunked_prefill_static_decode_and_generation(layout, record):
    """Greedy generation: GPU with the static cache (CUDA graph decode) and with chunked prefill, against the CPU's
    dynamic cache with the same prefill chunks (chunks change the order of the sums): the same tokens and step logits
    within the fp32 bound."""
    ids, mask = padded_batch(cpu_model(layout).config.vocab_size, T=90, pad=20, seed=5)
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)
    runs = {"static": dict(cache_implementation="static"), "chunked": dict(prefill_chunk_size=32),
            "static+chunked": dict(cache_implementation="static", prefill_chunk_size=32)}
    with torch.no_grad():
        gpu = gpu_model(layout)
        for name, extra in runs.items():
            chunks = {k: v for k, v in extra.items() if k == "prefill_chunk_size"}
            want = cpu_model(layout).generate(input_ids=ids, attention_mask=mask, **kw, **chunks)
            got = gpu.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **kw, **extra)
            assert torch.equal(got.sequences.cpu(), want.sequences), name
            err = max(rel_err(a.float().cpu(), b.float()) for a, b in zip(got.logits, want.logits))
            record(f"{layout} generation {name} step logits", err, fp32_bound(layout))


COMPONENTS = ("self_attn", "block_sparse_moe", "mlp")


def reference_forward(layout, ids, mask):
    """The fp32 CPU model's forward on (ids, mask), without a cache: (logits, {component: (args, kwargs, output,
    expert ids or None)}) with each layer's attention and feed-forward module's exact inputs and output, and a MoE
    block's top-k expert sets [tokens, k]."""
    model, calls, routes, hooks = cpu_model(layout), {}, {}, []
    for name, mod in model.named_modules():
        if name.endswith(COMPONENTS) and ".layers." in name:
            hooks.append(mod.register_forward_hook(
                lambda m, a, kw, o, name=name: keep(calls, name, copy.deepcopy((a, kw, o))), with_kwargs=True))
    hooks += route_hooks(model, routes)
    want = logits(model, ids, mask, use_cache=False)  # no cache: each call's inputs are its whole input
    for h in hooks:
        h.remove()
    return want, {name: (*call, routes.get(name)) for name, call in calls.items()}


def route_hooks(model, routes):
    """Hooks keeping each MoE block's first top-k expert sets (sorted, on the CPU) in `routes` by block name."""
    return [mod.register_forward_hook(  # the gate returns (logits, weights, expert ids [tokens, k])
            lambda m, a, o, name=name: keep(routes, name[:-len(".gate")], o[2].sort(-1).values.cpu()))
            for name, mod in model.named_modules() if name.endswith("block_sparse_moe.gate")]


def _bf16(x, device, key=""):
    """`x` as a bf16 model's module receives it: floating tensors in bf16 (an additive mask's fp32 minimum becomes
    bf16's, as a bf16 model builds it), everything else as is."""
    if torch.is_tensor(x):
        if x.is_floating_point():
            if "mask" in key:
                x = x.clamp(min=torch.finfo(torch.bfloat16).min)
            x = x.to(torch.bfloat16)
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_bf16(y, device, key) for y in x)
    if isinstance(x, dict):
        return {k: _bf16(v, device, k) for k, v in x.items()}
    return x


def bf16_components_alone(calls, model, mask):
    """{component: (error, share of tokens routed otherwise or None)}: each of the bf16 `model`'s components run on the
    fp32 model's inputs rounded to bf16, against the fp32 output, on the valid tokens; a MoE block on the tokens it
    routes to the reference's experts (a rounding that swaps one near-tied expert changes that token's output
    entirely). Each component's own bf16 error, not the compounded one."""
    device, modules, errors, routes = next(model.parameters()).device, dict(model.named_modules()), {}, {}
    hooks = route_hooks(model, routes)  # each MoE block runs once below: its routes on the reference's inputs
    v = mask.bool()
    for name, (args, kwargs, want, ref_routes) in calls.items():
        with torch.no_grad():
            got = _first_tensor(modules[name](*_bf16(args, device), **_bf16(kwargs, device))).float().cpu()
        want, rows, rerouted = _first_tensor(want), v, None
        if ref_routes is not None:
            same = (routes[name] == ref_routes).all(-1).view(v.shape)
            rerouted, rows = 1 - same[v].float().mean().item(), v & same
        got, want = (got.view(*v.shape, -1), want.view(*v.shape, -1))
        errors[name] = (rel_err(got[rows], want[rows]), rerouted)
    for h in hooks:
        h.remove()
    return errors


def bf16_logits_error(model, ids, mask, want, calls):
    """(error, share of tokens left out): the bf16 `model`'s logits against the fp32 ones (`want`, with the
    reference's routes in `calls`) on the valid tokens routed to the same experts in every MoE layer."""
    routes = {}
    hooks = route_hooks(model, routes)
    got = logits(model, ids, mask)
    for h in hooks:
        h.remove()
    v = mask.bool()
    alike = v.clone()
    for name, (*_, ref_routes) in calls.items():
        if ref_routes is not None:
            alike &= (ref_routes == routes[name]).all(-1).view(v.shape)
    return rel_err(got[alike], want[alike]), 1 - alike[v].float().mean().item()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_model_per_component(layout, record):
    """A bf16 model on the GPU against the fp32 CPU model. Each layer's attention and feed-forward module alone, on the
    fp32 model's inputs rounded to bf16: no further from the fp32 output than 3x what the same module of a bf16
    copy on the CPU (the PyTorch paths) gives on the same inputs, at least the `BF16` floor; the share of tokens a MoE
    block routes otherwise is bounded. The whole model's logits on the tokens routed alike in every layer: bf16
    errors compound over layers (on these random models the CPU bf16 copy's logits are 0.78 from fp32 for K3), so
    that bound is twice the CPU bf16 copy's own distance."""
    ids, mask = padded_batch(cpu_model(layout).config.vocab_size, T=120, pad=30, seed=9)
    want, calls = reference_forward(layout, ids, mask)
    cpu_bf16 = copy.deepcopy(cpu_model(layout)).to(torch.bfloat16)
    gpu = gpu_model(layout, torch.bfloat16)
    base, got = bf16_components_alone(calls, cpu_bf16, mask), bf16_components_alone(calls, gpu, mask)
    assert got and set(got) == set(base) == set(calls)
    for name, (err, rerouted) in got.items():
        if rerouted is not None:
            record(f"{layout} bf16 {name} alone: share of tokens routed otherwise", rerouted, BF16["rerouted"])
        record(f"{layout} bf16 {name} alone (CPU bf16: {base[name][0]:.2e})", err,
               max(BF16["component"], BF16["component_factor"] * base[name][0]))
    (base_err, _), (err, left_out) = (bf16_logits_error(m, ids, mask, want, calls) for m in (cpu_bf16, gpu))
    record(f"{layout} bf16 logits, {1 - left_out:.0%} of tokens (CPU bf16: {base_err:.2e})", err,
           max(BF16["logits"], 2 * base_err))


@pytest.mark.skipif(not os.path.isdir(ORACLE_A), reason=f"{ORACLE_A} is not present")
def test_oracle_a_strict_on_gpu(tmp_path, record):
    """Moonshot's own code on oracle A (fp32, CPU) against our fp32 model on the GPU: check_oracle.py --strict."""
    out = tmp_path / "oracle.json"
    proc = subprocess.run([sys.executable, os.path.join(ORACLE, "check_oracle.py"), ORACLE_A, "--device", "cuda",
                           "--strict", "--tol", "1e-4", "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name, res in json.load(open(out))["results"].items():
        if "rel" in res:
            record(f"oracle A {name}", res["rel"], 1e-5)
        if "tokens_match" in res:
            assert res["tokens_match"] is True, name


def _to(x, device):
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(y, device) for y in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _first_tensor(o):
    while isinstance(o, (tuple, list)):
        o = o[0]
    return o if torch.is_tensor(o) else getattr(o, "logits", getattr(o, "last_hidden_state", None))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_module_alone_in_fp32(layout, record):
    """Every submodule run on the GPU on the exact inputs the CPU model gave it (left-padded batch, no cache): its
    own error, not the accumulated one, so a logits error above the bound points at the module that makes it."""
    model = cpu_model(layout)
    ids, mask = padded_batch(model.config.vocab_size)
    calls, hooks = {}, []
    for name, mod in model.named_modules():
        if name and not isinstance(mod, torch.nn.ModuleList) and not hasattr(mod, "layers"):  # not whole stacks
            hooks.append(mod.register_forward_hook(
                lambda m, args, kwargs, out, name=name: keep(calls, name, copy.deepcopy((args, kwargs, out))),
                with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in hooks:
        h.remove()
    modules = dict(model.named_modules())
    errors = {}
    for name, (args, kwargs, out) in calls.items():
        want = _first_tensor(out)
        if want is None or not want.is_floating_point():
            continue
        with torch.no_grad():
            got = _first_tensor(copy.deepcopy(modules[name]).cuda()(*_to(args, "cuda"), **_to(kwargs, "cuda")))
        errors[name] = rel_err(got.float().cpu(), want.float())
    worst = sorted(errors, key=errors.get, reverse=True)[:5]
    print({n: f"{errors[n]:.2e}" for n in worst})  # the five largest, in the log whatever the outcome
    for name in worst:
        record(f"{layout} {name} ({type(modules[name]).__name__}) alone", errors[name], FP32)


KDA_BWD_CASE = r"""
import sys, torch
from kimi3_kernels.kda import chunk_kda, naive_chunk_kda
K, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
DEV = sys.argv[3] if len(sys.argv) > 3 else "cuda"
g = torch.Generator().manual_seed(3)
T, H = 280, 3
x = [torch.randn(1, T, H, d, generator=g) for d in (K, K, K, K)] + [torch.randn(1, T, H, generator=g)]
A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(H * K, generator=g) * 0.3
cu = torch.tensor([0, 60, 140, 200, 280], dtype=torch.int32)  # two rows of two packed documents
res = []
for fn, dev, dt in ((naive_chunk_kda, "cpu", torch.float64), (chunk_kda, DEV, dtype)):
    xs = [t.to(dev, dt).requires_grad_() for t in x]
    o, _ = fn(*xs, A_log=A_log.to(dev), dt_bias=dt_bias.to(dev), lower_bound=-3.0, cu_seqlens=cu.to(dev))
    o.float().pow(2).sum().backward()
    res.append([o.detach().double().cpu()] + [t.grad.double().cpu() for t in xs])
print(max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(res[1], res[0])))
"""


@pytest.mark.parametrize("K", [16, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kda_backward_of_packed_documents(K, dtype, record):
    """Chunked KDA forward and backward over packed documents (varlen, 3 heads) against the fp64 reference, each case
    in its own process so a kernel fault is reported as this case's failure and leaves the other tests' GPU intact."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", KDA_BWD_CASE, str(K), dtype], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record(f"KDA varlen forward+backward K={K} {dtype}", float(proc.stdout.split()[-1]),
           FP32_GRAD if dtype == "float32" else BF16["component"])


def test_fp32_logits_on_cuda(record):
    """config.fp32_logits on the GPU: the bf16 head's GEMM writes fp32 (no fp32 copy of the weight), equal to the fp32
    product of the same bf16 operands up to the order of the sums; static-cache generation (the recorded decode
    graphs hold the head) runs on it."""
    from kimi3_testing import ROOT
    from transformers_kimi3 import Kimi3ForCausalLM

    model = Kimi3ForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "kimi-k3-mini"), dtype=torch.bfloat16,
                                             fp32_logits=True).cuda().eval()
    ids = torch.randint(3, 7900, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    record("fp32_logits: bf16 GEMM with fp32 output vs fp32 product of the same operands",
           rel_err(logits, h.float() @ model.lm_head.weight.float().t()), 1e-5)
    static = model.generate(ids, cache_implementation="static", do_sample=False, max_new_tokens=12)
    assert static.shape[0] == 2 and 64 < static.shape[1] <= 76, static.shape  # shorter where both rows end (EOS)
    record("fp32_logits: static-cache generation's first token against the prompt's fp32 logits' argmax",
           float((static[:, 64] != logits[:, -1].argmax(-1)).sum()), 0.5)
