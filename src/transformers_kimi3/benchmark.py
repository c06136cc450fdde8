"""`python -m transformers_kimi3 bench`: a quick timing of the model on this machine. Nothing is written to disk.

A model with random weights is built in memory and timed: prefill tokens/s at a few prompt lengths, and greedy
decode tokens/s with the dynamic cache and with `cache_implementation="static"` (on CUDA, CUDA-graph replay). On a
GPU it is the 4.3B Kimi Linear benchmark config in bf16; on the CPU a toy config in fp32, a smoke test rather than a
speed measurement. The comparisons with native Transformers and fla live in the repository's bench/ folder.
"""

import time

import torch

# The 4.3B Kimi Linear benchmark config (Transformers' KimiLinearConfig names): hidden 2304, 8 layers (KDA:MLA 7:1),
# 64 experts top-8 of width 1024.
GPU_CONFIG = dict(hidden_size=2304, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32,
                  num_local_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, intermediate_size=9216,
                  vocab_size=163840, linear_num_heads=32, linear_head_dim=128)
CPU_CONFIG = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
                  num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                  vocab_size=512, linear_num_heads=2, linear_head_dim=32, kv_lora_rank=32, qk_rope_head_dim=16,
                  qk_nope_head_dim=32, v_head_dim=32)


def build(device, dtype, config_kwargs):
    """Our Kimi3ForCausalLM at a Kimi Linear config, random weights (seed 0), built directly on `device`."""
    from transformers import KimiLinearConfig

    from .configuration_kimi3 import Kimi3TextConfig
    from .modeling_kimi3 import Kimi3ForCausalLM

    fields = KimiLinearConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **config_kwargs).to_dict()
    fields.pop("model_type", None)
    torch.manual_seed(0)
    with torch.device(device):
        return Kimi3ForCausalLM(Kimi3TextConfig(**fields)).to(dtype).eval()


def seconds(fn, device, reps=3):
    """Median wall seconds of `reps` synchronised calls, after one untimed call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2]


@torch.no_grad()
def run(device, prefill=(2048, 8192), batches=(1, 8), prompt=512, new_tokens=32):
    """Rows of (what, setting, tokens/s) for the model on `device`."""
    on_gpu = device.type == "cuda"
    model = build(device, torch.bfloat16 if on_gpu else torch.float32, GPU_CONFIG if on_gpu else CPU_CONFIG)
    vocab, rows = model.config.vocab_size, []
    for T in prefill:
        ids = torch.randint(3, vocab, (1, T), device=device)
        s = seconds(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device)
        rows.append(("prefill", f"T={T}", T / s))
    for B in batches:
        ids = torch.randint(3, vocab, (B, prompt), device=device)
        for cache in ("dynamic", "static"):
            def gen(n, cache=cache):
                extra = {"cache_implementation": "static"} if cache == "static" else {}
                return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                      **extra)
            # the decode steps alone: generate(new + 1) minus generate(1), which is the prefill and first token
            s = max(seconds(lambda: gen(new_tokens + 1), device) - seconds(lambda: gen(1), device), 1e-9)
            rows.append((f"decode, {cache} cache", f"B={B}", B * new_tokens / s))
    return rows


def main(args):
    import transformers

    import transformers_kimi3

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this torch build sees no CUDA device")
    prefill = [int(x) for x in args.prefill.split(",")] if args.prefill else (
        (2048, 8192) if device.type == "cuda" else (32,))
    batches = [int(x) for x in args.batches.split(",")] if args.batches else ((1, 8) if device.type == "cuda" else (1,))
    prompt, new_tokens = (512, 32) if device.type == "cuda" else (16, 4)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (toy config: a smoke test)"
    kda = transformers_kimi3.kernel_status(device)["kda"]
    print(f"{name} | torch {torch.__version__} | transformers {transformers.__version__} | "
          f"KDA backend {kda['backend']}")
    for what, setting, tok_s in run(device, prefill, batches, prompt, args.new_tokens or new_tokens):
        print(f"{what:22s} {setting:8s} {tok_s:>12,.1f} tokens/s")
