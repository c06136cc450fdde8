"""Tiny configs and helpers shared by the model tests (not a test module)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE = os.path.join(os.path.dirname(ROOT), "shared", "oracle")
ORACLE_A = os.path.join(ORACLE, "A")
needs_oracle = pytest.mark.skipif(not os.path.isdir(ORACLE_A), reason="../shared/oracle/A is not present")


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
