"""Tiny configs and helpers shared by the model tests (not a test module)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the oracle folder beside the checkout (../shared/oracle), or a copy inside it (shared/oracle: the GPU machine)
ORACLE = next((p for p in (os.path.join(os.path.dirname(ROOT), "shared", "oracle"), os.path.join(ROOT, "shared", "oracle"))
               if os.path.isdir(p)), os.path.join(os.path.dirname(ROOT), "shared", "oracle"))
ORACLE_A = os.path.join(ORACLE, "A")
needs_oracle = pytest.mark.skipif(not os.path.isdir(ORACLE_A), reason=f"the oracle folder {ORACLE_A} is not present")


def tiny_k3_text_config(**overrides):
    """K3 features on (AttnRes, latent MoE, SiTU, bounded gate, gated MLA) at toy sizes; 7 layers, 2 MLA."""
    from transformers_kimi3 import Kimi3TextConfig

    kw = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=7,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1, routed_expert_hidden_size=32,
        attn_res_block_size=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=[1, 2, 3, 5, 6], full_attn_layers=[4, 7]),
    )
    kw.update(overrides)
    return Kimi3TextConfig.k3(**kw)


def tiny_model(seed=0, **overrides):
    """A random tiny K3 text model in fp32 with weights scaled so every mechanism is active."""
    from transformers_kimi3 import Kimi3ForCausalLM

    torch.manual_seed(seed)
    model = Kimi3ForCausalLM(tiny_k3_text_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.5)  # non-uniform AttnRes mixing
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
            elif name.endswith("A_log"):
                p.uniform_(-1, 1)
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


# Prepended to subprocess code: transformers_kimi3 and kimi3_kernels cannot be imported there, and the code checks
# that, so a test using it proves that remote code alone loads the model.
BLOCK_PACKAGE = """
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('transformers_kimi3', 'kimi3_kernels'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, _Block())
try:
    import transformers_kimi3
    raise SystemExit('the package is importable: the test would prove nothing')
except ImportError:
    pass
"""


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def run_python(code, env=None, timeout=600):
    """Run code in a fresh interpreter; returns CompletedProcess (stdout+stderr text)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout)


NATIVE = "transformers.models.kimi_linear.modeling_kimi_linear"


def native_kimi_linear_module():
    """Transformers' native Kimi Linear module, imported with fla hidden: it binds fla's GPU-only kernels at
    import when fla is installed, and on CPU we need its PyTorch path. fla is given back afterwards."""
    import importlib
    import sys

    transformers = pytest.importorskip("transformers")
    if getattr(transformers, "KimiLinearConfig", None) is None:
        pytest.skip("this Transformers has no native Kimi Linear")
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.") or k == NATIVE}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None
    try:
        return importlib.import_module(NATIVE)
    finally:
        del sys.modules["fla"]
        sys.modules.update({k: v for k, v in saved.items() if k != NATIVE})


def native_kimi_linear(q_lora_rank=None):
    """A tiny random native KimiLinearForCausalLM (5 layers, 2 MLA) with a non-zero router bias."""
    from transformers import KimiLinearConfig

    lib = native_kimi_linear_module()
    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=80, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_local_experts=6, num_experts_per_tok=2, linear_head_dim=16,
        linear_num_heads=3, routed_scaling_factor=2.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
    model = lib.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
    return model


def run_decode_ptx(asm, x, scales, G=None, n_out=4):
    """Execute an MXFP4 decode's inline PTX (its few opcodes) on one 32-bit word x and 4 scale words: returns $0..$3
    (the Triton kernel's table decode, tests/test_mxfp4_triton.py; the Gluon kernel's table-free one,
    tests/test_mxfp4_wgmma.py).
    With G (the module), the table operands $9..$16 are made as `_lut_words` makes them, from the first scale word
    through G.ZERO_PTX (executed here too). n_out=1: run a one-output asm (ZERO_PTX: x = $1)."""
    import struct


    def bf16(h):
        return struct.unpack("<f", struct.pack("<I", h << 16))[0]

    def to_bf16(v):
        return torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF

    regs = {"$1": x} if n_out == 1 else {"$4": x, **{f"${5 + i}": sc for i, sc in enumerate(scales)}}
    if G is not None:
        for i, sc in enumerate(scales):  # each element's own table words, from its own scale word
            z = run_decode_ptx(G.ZERO_PTX, sc, [], n_out=1)[0]
            regs[f"${9 + i}"], regs[f"${13 + i}"] = z | G.LUT_WORDS[0], z | G.LUT_WORDS[1]
    val = (lambda o: regs[o] if o in regs else int(o, 0) & 0xFFFFFFFF)
    for ln in asm.strip("{}").split(";"):
        ln = ln.strip()
        if not ln or ln.startswith(".reg"):
            continue
        op, args = ln.split(None, 1)
        d, *a = [t.strip() for t in args.split(",")]
        v = [val(t) for t in a]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "xor.b32":
            r = v[0] ^ v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":  # default mode: selector nibble bit 3 = replicate the top bit of the picked byte
            src = v[0] | (v[1] << 32)
            r = 0
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 15
                byte = (src >> (8 * (sel & 7))) & 0xFF
                r |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        elif op == "lop3.b32":
            r = 0
            for bit in range(32):
                i = (((v[0] >> bit) & 1) << 2) | (((v[1] >> bit) & 1) << 1) | ((v[2] >> bit) & 1)
                r |= ((v[3] >> i) & 1) << bit
        elif op == "fma.rn.bf16x2":  # the products here are exact: round once, as the hardware does
            r = 0
            for half in (0, 16):
                f = [bf16((t >> half) & 0xFFFF) for t in v]
                r |= to_bf16(f[0] * f[1] + f[2]) << half
        else:
            raise AssertionError(f"unexpected PTX opcode {op}")
        regs[d] = r
    return [regs[f"${i}"] for i in range(n_out)]


# two MLA layers, both MoE: the routed-expert mechanisms (QAT, LoRA on packed experts) at the smallest cost
MOE_MICRO = dict(num_hidden_layers=2, first_k_dense_replace=0, attn_res_block_size=1,
                 linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                         use_full_rank_gate=True, kda_layers=[], full_attn_layers=[1, 2]))


def checkpointing_argument():
    """TrainingArguments' name for gradient checkpointing in the installed Transformers."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def once_per_run(tmp_path_factory, name, make):
    """A module fixture's costly work (a subprocess, a training run) done once per test run: `make(folder)` writes
    what it produces into `folder`, an empty folder that every pytest-xdist worker of the run sees (the run's temporary
    folder, above the workers' own). The first worker to get here makes it under a lock; another one waits and reads
    it (pytest-xdist hands out a module's tests in chunks, so two workers may each need the fixture). A failed `make`
    leaves nothing behind: the next worker tries again and fails in the same way. Returns the folder."""
    import shutil

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def interpreted_results(tmp_path_factory, name, script):
    """The JSON a test file's worker prints (`RESULT {...}`) when `script` runs under TRITON_INTERPRET=1 in a
    subprocess (Triton reads the variable at launch, and other test files in the process compile for real), once per
    test run (`once_per_run`): a second pytest-xdist worker reads them instead of running the interpreter again."""
    import json
    import subprocess
    import sys

    def run(folder):
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                              cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        (folder / "results.json").write_text(lines[-1][len("RESULT "):])

    return json.loads((once_per_run(tmp_path_factory, name, run) / "results.json").read_text())
