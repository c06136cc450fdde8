#!/usr/bin/env python
"""Write the bundled tiny Kimi K3 checkpoint (official layout, MXFP4 routed experts, tiny K3-format tokenizer).

    python conversion/make_tiny_checkpoint.py --out assets/kimi-k3-tiny
    python -m kimi3_conversion.make_tiny_checkpoint --out assets/kimi-k3-tiny     # the same

Deterministic: a fixed seed, CPU fp32 init, then the official storage dtypes (bf16, fp32 for the KDA gate/conv
tensors and the router bias, MXFP4 for the routed experts). Every K3 mechanism is active at toy sizes: KDA with
the bounded gate, gated MLA with NoPE, Block AttnRes (block 3), latent MoE with SiTU-GLU, MoonViT-V2 + projector.
"""

import argparse
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from transformers_kimi3 import (
    Kimi3Config,
    Kimi3ForConditionalGeneration,
    Kimi3ImageProcessor,
    Kimi3Processor,
    Kimi3TextConfig,
)
from transformers_kimi3.checkpoint import to_official_layout
from transformers_kimi3.tiny_tokenizer import build_tiny_tokenizer

from kimi3_conversion.quantize_job import MXFP4_QUANTIZATION_CONFIG

SEED = 1234
FP32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")


def tiny_config(tok):
    text = Kimi3TextConfig.k3(
        vocab_size=tok["vocab_size"], hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=8, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        routed_expert_hidden_size=64, attn_res_block_size=3, max_position_embeddings=4096,
        bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"], pad_token_id=tok["pad_token_id"],
        linear_attn_config=dict(num_heads=4, head_dim=32, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=[1, 2, 3, 5, 6], full_attn_layers=[4, 7, 8]),
        quantization_config=MXFP4_QUANTIZATION_CONFIG)
    vision = dict(init_pos_emb_height=8, init_pos_emb_width=8, vt_hidden_size=32, vt_intermediate_size=64,
                  vt_num_attention_heads=2, vt_num_hidden_layers=2, qkv_hidden_size=48, mm_hidden_size=32,
                  text_hidden_size=128)
    return Kimi3Config(text_config=text, vision_config=vision,
                       media_placeholder_token_id=tok["media_placeholder_token_id"],
                       architectures=["KimiK3ForConditionalGeneration"])


def make_weights(config):
    torch.manual_seed(SEED)
    quant, config.text_config.checkpoint_quantization_config = config.text_config.checkpoint_quantization_config, None
    model = Kimi3ForConditionalGeneration(config).eval()  # float experts to initialise; packed on export
    config.text_config.checkpoint_quantization_config = quant
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.5)  # random weights, but with non-uniform AttnRes mixing
            elif name.endswith("A_log"):
                p.uniform_(-1, 1)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    sd = model.state_dict()
    text = {k[len("language_model."):]: v for k, v in sd.items() if k.startswith("language_model.")}
    official = {"language_model." + k: v for k, v in
                to_official_layout(text, config.text_config, pack_experts=True).items()}
    official.update({k: v for k, v in sd.items() if not k.startswith("language_model.")})
    return {k: (v if v.dtype == torch.uint8 else v.to(torch.float32 if k.endswith(FP32_SUFFIXES) else
                                                      torch.bfloat16)).contiguous()
            for k, v in official.items()}


def _drop_auto_map(path):
    def strip(d):
        if isinstance(d, dict):
            d.pop("auto_map", None)
            for v in d.values():
                strip(v)
    data = json.load(open(path))
    strip(data)
    json.dump(data, open(path, "w"), indent=2, sort_keys=True)


def write_folder(folder):
    """Every file of the bundled checkpoint into `folder`. Returns the tensors written."""
    tok = build_tiny_tokenizer(folder, vocab_size=512)
    config = tiny_config(tok)
    tensors = make_weights(config)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    Kimi3Processor(image_processor=Kimi3ImageProcessor(), tokenizer=AutoTokenizer.from_pretrained(folder)
                   ).save_pretrained(folder)
    build_tiny_tokenizer(folder, vocab_size=512)  # the processor rewrote the tokenizer files in Transformers' form
    for f in os.listdir(folder):  # save_pretrained copies our remote code; the bundled folder is layout only
        if f.endswith(".py"):
            os.remove(os.path.join(folder, f))
        elif f.endswith(".json") and f != "config.json":
            _drop_auto_map(os.path.join(folder, f))
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg.pop("auto_map", None)  # official layout only; the package's registered classes load it
    cfg.pop("transformers_version", None)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"), indent=2, sort_keys=True)
    json.dump({"bos_token_id": tok["bos_token_id"], "eos_token_id": tok["eos_token_id"],
               "pad_token_id": tok["pad_token_id"], "do_sample": False},
              open(os.path.join(folder, "generation_config.json"), "w"), indent=2)
    card = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model_cards", "kimi-k3-tiny.md")
    if os.path.exists(card):
        shutil.copy(card, os.path.join(folder, "README.md"))
    os.chmod(folder, 0o755)
    for f in os.listdir(folder):
        os.chmod(os.path.join(folder, f), 0o644)
    return tensors


def _replace(new, out):
    """Put folder `new` at `out`. An existing `out` is replaced only when it holds nothing but files of the names
    this script writes (an earlier build); anything else there is refused, never deleted."""
    if not os.path.exists(out):
        os.replace(new, out)
        return
    theirs = sorted(set(os.listdir(out)) - set(os.listdir(new))) if os.path.isdir(out) else [out]
    if theirs or any(not os.path.isfile(os.path.join(out, f)) for f in os.listdir(out)):
        raise SystemExit(f"error: {out} holds files this script does not write ({', '.join(theirs[:5]) or 'folders'}"
                         "); move them away or choose another --out")
    old = f"{out}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(new, out)  # a complete folder appears at once, never a partial one
    shutil.rmtree(old)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/kimi-k3-tiny",
                    help="output folder; an existing one is replaced only if it holds nothing but this script's "
                         "files (default: assets/kimi-k3-tiny)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix=".kimi-k3-tiny-", dir=os.path.dirname(os.path.abspath(args.out)))
    try:
        tensors = write_folder(tmp)
        _replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    print(f"wrote {args.out}: {sum(t.numel() for t in tensors.values())} stored elements in {len(tensors)} tensors")


if __name__ == "__main__":
    main()
