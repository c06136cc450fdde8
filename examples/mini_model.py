"""Configs of kimi-k3-mini and its draft model, their sizes, and the export to the official layout.

Every K3 component is on at every size: KDA with the lower-bounded gate (-5) and the full-rank output gate, gated
MLA without positional encoding (NoPE), Block Attention Residuals, a dense first layer, then Stable LatentMoE
(routed experts in a latent width, SiTU-GLU, a shared expert, sigmoid router with correction bias), and for the
mini model MoonViT-V2 with the patch-merger projector. Full attention (MLA) sits at every fourth layer and the last,
KDA everywhere else, as in K3. The draft model is text only (`Kimi3ForCausalLM`) with the same tokenizer.

The export packs the routed experts into MXFP4 (`PackedMXFP4Experts.from_experts`, the released compressed-tensors
`quantization_config`), stores everything else in bf16 except the tensors K3 keeps in fp32, and writes the folder
with the model's own `save_pretrained` (official tensor names), the tokenizer / processor files and a model card.
"""

import json
import os
import shutil

import torch

from transformers_kimi3 import Kimi3Config, Kimi3ForCausalLM, Kimi3ForConditionalGeneration, Kimi3TextConfig
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")

# hidden, layers, dense FFN width, experts, top-k, expert width, latent width, heads, head dim, AttnRes block
TEXT_SIZES = {
    "mini": dict(hidden=256, layers=8, ffn=768, experts=32, top_k=4, expert_ffn=128, latent=128, heads=4, head_dim=64,
                 block=4),
    "draft": dict(hidden=96, layers=4, ffn=256, experts=8, top_k=2, expert_ffn=64, latent=64, heads=2, head_dim=32,
                  block=2),
    "smoke": dict(hidden=64, layers=4, ffn=128, experts=4, top_k=2, expert_ffn=32, latent=32, heads=2, head_dim=32,
                  block=2),
    "smoke-draft": dict(hidden=32, layers=2, ffn=64, experts=4, top_k=2, expert_ffn=32, latent=32, heads=1, head_dim=32,
                        block=1),
}
# The Kimi Linear layout (Transformers' `KimiLinearConfig`): no Block Attention Residuals, ordinary MoE (experts in
# the model width), KDA with Kimi Linear's gate (no lower bound), MLA at every fourth layer and the last, a dense first
# layer. Text only; trained by the "linear-text" phase to compare with Transformers' native KimiLinearForCausalLM.
LINEAR_SIZES = {
    "linear": dict(hidden=256, layers=8, ffn=768, experts=32, top_k=4, expert_ffn=128, heads=4, head_dim=64),
    "smoke-linear": dict(hidden=64, layers=4, ffn=128, experts=4, top_k=2, expert_ffn=32, heads=2, head_dim=32),
}
VISION_SIZES = {
    "mini": dict(vt_hidden_size=128, vt_intermediate_size=512, vt_num_attention_heads=2, vt_num_hidden_layers=4,
                 qkv_hidden_size=128, mm_hidden_size=128, init_pos_emb_height=32, init_pos_emb_width=32),
    "smoke": dict(vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=1,
                  qkv_hidden_size=32, mm_hidden_size=32, init_pos_emb_height=8, init_pos_emb_width=8),
}


def text_config(size, ids):
    s = TEXT_SIZES[size]
    layers = s["layers"]
    full = sorted({i for i in range(4, layers + 1, 4)} | {layers})
    return Kimi3TextConfig.k3(
        vocab_size=ids["vocab_size"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        moe_intermediate_size=s["expert_ffn"], num_hidden_layers=layers, num_attention_heads=s["heads"],
        q_lora_rank=s["hidden"] // 2, kv_lora_rank=s["hidden"] // 4, qk_nope_head_dim=s["head_dim"] // 2,
        qk_rope_head_dim=s["head_dim"] // 4, v_head_dim=s["head_dim"], num_experts=s["experts"],
        num_experts_per_token=s["top_k"], num_shared_experts=1, routed_expert_hidden_size=s["latent"],
        attn_res_block_size=s["block"], first_k_dense_replace=1, max_position_embeddings=8192,
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
        linear_attn_config=dict(num_heads=s["heads"], head_dim=s["head_dim"], short_conv_kernel_size=4,
                                gate_lower_bound=-5.0, use_full_rank_gate=True, full_attn_layers=full,
                                kda_layers=[i for i in range(1, layers + 1) if i not in full]))


def linear_config(size, ids):
    """A `Kimi3TextConfig` in the Kimi Linear layout, made from Transformers' `KimiLinearConfig` fields, as our loader
    reads a native Kimi Linear folder: what we save of it, native `KimiLinearForCausalLM` loads."""
    from transformers import KimiLinearConfig

    s = LINEAR_SIZES[size]
    layers = s["layers"]
    full = {i for i in range(4, layers + 1, 4)} | {layers}
    fields = KimiLinearConfig(
        vocab_size=ids["vocab_size"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        moe_intermediate_size=s["expert_ffn"], num_hidden_layers=layers, num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"], kv_lora_rank=s["hidden"] // 4, q_lora_rank=None,
        qk_nope_head_dim=s["head_dim"] // 2, qk_rope_head_dim=s["head_dim"] // 4, v_head_dim=s["head_dim"],
        num_local_experts=s["experts"], num_experts_per_tok=s["top_k"], n_shared_experts=1,
        linear_num_heads=s["heads"], linear_head_dim=s["head_dim"], linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i in full else "linear_attention" for i in range(1, layers + 1)],
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), max_position_embeddings=8192,
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
    ).to_dict()
    fields.pop("model_type", None)
    return Kimi3TextConfig(**fields)


def mini_config(size, ids):
    """The multimodal config (`Kimi3Config`) of "mini" or "smoke"."""
    vision = dict(VISION_SIZES[size], text_hidden_size=TEXT_SIZES[size]["hidden"])
    return Kimi3Config(text_config=text_config(size, ids), vision_config=vision,
                       media_placeholder_token_id=ids["media_placeholder_token_id"],
                       architectures=["KimiK3ForConditionalGeneration"])


def new_model(config, seed):
    """A freshly initialised model (fp32, CPU), the same for a seed."""
    torch.manual_seed(seed)
    cls = Kimi3ForConditionalGeneration if isinstance(config, Kimi3Config) else Kimi3ForCausalLM
    return cls(config)


def parameter_counts(model):
    """{"total", "routed_experts", "embeddings", "vision", "active_per_token", "stored_mb"} (stored_mb: bf16 plus
    MXFP4 experts at 4.25 bits per weight)."""
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    emb = sum(p.numel() for n, p in named.items() if "embed_tokens" in n or "lm_head" in n)
    vision = sum(p.numel() for n, p in named.items() if n.startswith(("vision_tower", "mm_projector")))
    text = model.config.get_text_config()
    active = total - experts + experts * text.num_experts_per_token // text.num_experts
    return {"total": total, "routed_experts": experts, "embeddings": emb, "vision": vision,
            "active_per_token": active, "stored_mb": round(((total - experts) * 2 + experts * 4.25 / 8) / 1e6, 2)}


# ----------------------------------------------------------------------------- export
def mxfp4_quantization_config():
    """The released compressed-tensors MXFP4 description, as the bundled tiny K3 checkpoint states it."""
    with open(os.path.join(ROOT, "assets", "kimi-k3-tiny", "config.json")) as f:
        return json.load(f)["text_config"]["quantization_config"]


def pack_experts(model):
    """Replace every float routed-expert module by its MXFP4 pack; mark the config as MXFP4."""
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if hasattr(module, "gate") and experts is not None and not isinstance(experts, PackedMXFP4Experts):
            module.experts = PackedMXFP4Experts.from_experts(experts)
    model.config.get_text_config().checkpoint_quantization_config = mxfp4_quantization_config()
    return model


def official_dtypes(state_dict):
    return {k: v if v.dtype == torch.uint8 else v.to(torch.float32 if k.endswith(FP32_SUFFIXES) else torch.bfloat16)
            for k, v in state_dict.items()}


def _drop_auto_map(value):
    if isinstance(value, dict):
        value.pop("auto_map", None)
        for v in value.values():
            _drop_auto_map(v)
    return value


def export_folder(model, processor_or_tokenizer, tokenizer_dir, out_dir, card, stop_ids, max_shard_size="15MB"):
    """Write `model` (float experts, any dtype) to `out_dir` in the official layout with MXFP4 experts: the weights
    in shards of at most `max_shard_size`, the processor (or tokenizer) files with the trained tokenizer's own files
    on top, `generation_config.json` (greedy, stopping at any of `stop_ids`) and `README.md` = `card`. No remote
    code: the package loads it."""
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model = pack_experts(model.float().eval())
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = list(stop_ids)
    model.save_pretrained(tmp, state_dict=official_dtypes(model.state_dict()), max_shard_size=max_shard_size)
    processor_or_tokenizer.save_pretrained(tmp)
    for name in os.listdir(tokenizer_dir):  # the files as trained (the save above rewrites them in its own form)
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if name.endswith(".py"):
            os.remove(path)
        elif name.endswith(".json"):
            with open(path) as f:
                data = _drop_auto_map(json.load(f))
            if name == "config.json":  # official class names; no dtype (the tensors carry theirs)
                data.pop("transformers_version", None)
                data["architectures"] = ["KimiK3ForConditionalGeneration" if "text_config" in data else
                                         "KimiLinearForCausalLM"]
                data["dtype"] = None
                for sub in ("text_config", "vision_config"):
                    if sub in data:
                        data[sub]["dtype"] = None
            if name in ("config.json", "generation_config.json"):  # training turns the cache off; generation wants it
                for cfg in (data, data.get("text_config", {})):
                    if "use_cache" in cfg:
                        cfg["use_cache"] = True
            with open(path, "w") as f:
                json.dump(data, f, indent=2, sort_keys=name == "config.json", ensure_ascii=False)
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(card)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
