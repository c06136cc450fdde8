"""`python -m transformers_kimi3 demo --model FOLDER`: load, generate, report the KDA backend and speed.
`python -m transformers_kimi3 bench`: a quick timing of the model on this machine (see benchmark.py)."""

import argparse
import time

import torch


def demo(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transformers_kimi3

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    print(f"model: {type(model).__name__} from {args.model} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception as e:  # noqa: BLE001 - a folder without tokenizer still demos on ids
        tokenizer = None
        print(f"no tokenizer ({type(e).__name__}); printing ids only")
    prompt = args.prompt
    ids = tokenizer(prompt, return_tensors="pt").input_ids if tokenizer else torch.tensor([[1, 2, 3, 4, 5]])
    pad = model.config.get_text_config().pad_token_id
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up: one-time set-up costs
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
        seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:]
    print(f"prompt: {prompt!r}")
    print(f"generated ids: {new.tolist()}")
    if tokenizer:
        print(f"generated text: {tokenizer.decode(new)!r}")
    kda = transformers_kimi3.kernel_status(ids.device)["kda"]
    print(f"KDA backend: {kda['backend']} on {ids.device.type}")
    print(f"speed: {new.numel() / seconds:.1f} tokens/s ({new.numel()} tokens in {seconds:.2f} s, prefill included)")
    if hasattr(model, "vision_tower"):
        image_question(args, model, pad)


def image_question(args, model, pad):
    import numpy as np
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.model)
    y, x = np.mgrid[0:56, 0:84]
    image = np.stack([x * 3, y * 4, (x + y) * 2], -1).astype(np.uint8)  # a synthetic 84x56 gradient
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=pad)
    new = out[0, inputs["input_ids"].shape[1]:]
    print(f"image question: {messages[0]['content'][1]['text']!r} with an 84x56 image "
          f"({int(inputs['grid_thws'][0, 1] * inputs['grid_thws'][0, 2] // 4)} image positions)")
    print(f"answer ids: {new.tolist()}")
    print(f"answer text: {processor.decode(new, skip_special_tokens=False)!r}")


def main():
    ap = argparse.ArgumentParser(prog="python -m transformers_kimi3")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="generate with a (tiny) Kimi K3 folder")
    d.add_argument("--model", default="assets/kimi-k3-tiny")
    d.add_argument("--prompt", default="Kimi K3 is a model that")
    d.add_argument("--max-new-tokens", type=int, default=24)
    b = sub.add_parser("bench", help="a quick timing of the model on this machine (prefill, decode); writes nothing")
    b.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    b.add_argument("--prefill", default=None, help="prompt lengths, e.g. 2048,8192")
    b.add_argument("--batches", default=None, help="decode batch sizes, e.g. 1,8")
    b.add_argument("--new-tokens", type=int, default=None, help="decode steps timed per batch")
    args = ap.parse_args()
    if args.cmd == "demo":
        demo(args)
    else:
        from .benchmark import main as bench

        bench(args)


if __name__ == "__main__":
    main()
