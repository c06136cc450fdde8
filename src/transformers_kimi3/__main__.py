"""`python -m transformers_kimi3 demo [--model FOLDER]`: load a Kimi K3 folder (default: the bundled kimi-k3-mini,
a small K3 trained by examples/train_kimi3_mini.py), continue a prompt, answer a question about a drawn picture and
one chat turn, report the KDA backend and speed.
`python -m transformers_kimi3 bench`: a quick timing of the model on this machine (see benchmark.py).
`python -m transformers_kimi3 plan --gpus 8 --offload-experts`: where the released K3's weights go on N GPUs (and host
memory), planned on the meta device (see placement.py)."""

import argparse
import os
import time

import torch

BUNDLED_MODEL = os.path.join("assets", "kimi-k3-mini")
# the repository checkout this module lies in: src/transformers_kimi3/__main__.py -> the checkout's root
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bundled_model_candidates():
    """Where the bundled checkpoint is looked for: the checkout this package runs from (an editable install),
    then the working folder (a wheel installed elsewhere, run from a checkout)."""
    return list(dict.fromkeys([os.path.join(REPO_ROOT, BUNDLED_MODEL), os.path.abspath(BUNDLED_MODEL)]))


def resolve_model(model):
    """The folder or Hub id the demo loads: `model` as given, or for None the bundled checkpoint, found
    whatever the working folder and never looked up on the Hub."""
    if model is not None:
        # a path, not a Hub id: absolute, relative by its start, deeper than owner/name, or under a folder here
        looks_local = (os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1
                       or os.path.isdir(model.split("/")[0]))
        if looks_local and not os.path.isdir(os.path.expanduser(model)):
            raise SystemExit(f"error: --model {model}: no such folder (a Hub id is 'owner/name')")
        return os.path.expanduser(model) if looks_local else model
    places = bundled_model_candidates()
    for folder in places:
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise SystemExit(f"error: the bundled checkpoint {BUNDLED_MODEL} is not in {' or '.join(places)} (it ships "
                     "with a repository checkout, not with an installed wheel); pass --model with a local folder "
                     "or a Hub id")


def parameter_count(model):
    """Parameters of `model` as its model card states them: every element of `model.parameters()`, plus each packed
    MXFP4 expert weight at its logical size, 2 values per packed byte. The E8M0 scales and the other buffers (the
    router's correction bias) are not counted. This equals the `model.parameters()` count of the same model with
    float experts, so a checkpoint has one number whether its experts are packed or not."""
    from .mxfp4_experts import PackedMXFP4Experts

    n = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, PackedMXFP4Experts):
            n += 2 * sum(getattr(module, f"{w}_packed").numel() for w in ("w1", "w2", "w3"))
    return n


def demo(args):
    from transformers import AutoTokenizer

    import transformers_kimi3

    path = resolve_model(args.model)
    local = {"local_files_only": True} if args.model is None else {}  # the bundled model: never the network
    # our classes, not the Auto classes: for a Kimi Linear folder these would pick Transformers' native class
    model_type = transformers_kimi3.Kimi3Config.get_config_dict(path, **local)[0].get("model_type")
    cls = (transformers_kimi3.Kimi3ForConditionalGeneration if model_type == "kimi_k3"
           else transformers_kimi3.Kimi3ForCausalLM)
    model = cls.from_pretrained(path, dtype=torch.float32, **local).eval()
    print(f"model: {type(model).__name__} from {path} ({parameter_count(model) / 1e6:.2f}M parameters)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **local)
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
        # the text up to the first control token: a chat-tuned model ends a continuation with message closers
        control = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        ids_new = new.tolist()
        cut = next((i for i, t in enumerate(ids_new) if t in control), len(ids_new))
        print(f"generated text: {tokenizer.decode(ids_new[:cut])!r}"
              + (f" (then {len(ids_new) - cut} tokens of chat markup)" if cut < len(ids_new) else ""))
    kda = transformers_kimi3.kernel_status(ids.device)["kda"]
    print(f"KDA backend: {kda['backend']} on {ids.device.type}")
    print(f"speed: {new.numel() / seconds:.1f} tokens/s ({new.numel()} tokens in {seconds:.2f} s, prefill included)")
    if hasattr(model, "vision_tower"):
        image_question(path, model, pad, local, args.max_new_tokens)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        chat_turn(tokenizer, model, pad, args.question, args.max_new_tokens)


def red_circle(width=160, height=120):
    """A red circle on a white background (the kind of picture kimi-k3-mini was trained on), as an RGB array."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    image = np.full((height, width, 3), 250, dtype=np.uint8)
    image[(x - width * 0.4) ** 2 + (y - height * 0.5) ** 2 < (height * 0.3) ** 2] = (220, 30, 30)
    return image


def image_question(path, model, pad, local, max_new_tokens):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, **local)
    question = "What colour is the circle?"
    messages = [{"role": "user", "content": [{"type": "image", "image": red_circle()},
                                             {"type": "text", "text": question}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt", thinking=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    new = out[0, inputs["input_ids"].shape[1]:]
    print(f"image question: {question!r} about a red circle on white, 160x120 "
          f"({int(inputs['grid_thws'][0, 1] * inputs['grid_thws'][0, 2] // 4)} image positions)")
    print(f"answer: {processor.parse_output(new, prompt=inputs['input_ids'])['content']!r}")


def chat_turn(tokenizer, model, pad, question, max_new_tokens):
    from .processing_kimi3 import parse_kimi3_output

    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                        thinking=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    print(f"chat: {question!r}")
    # the reply's text: the XTML markers that close the assistant message are plain tokens (`parse_kimi3_output`)
    reply = parse_kimi3_output(tokenizer.decode(out[0, ids.shape[1]:]), prefix=tokenizer.decode(ids[0]))["content"]
    print(f"reply: {reply!r}")


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m transformers_kimi3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{demo,bench,plan}", help="what to run")
    d = sub.add_parser("demo", help="generate with a Kimi K3 folder",
                       description="Load a Kimi K3 folder, continue a prompt greedily (ids, text, KDA backend, "
                                   "tokens/s), answer a question about a drawn picture (vision models) and one chat "
                                   "turn (folders with a chat template).")
    d.add_argument("--model", default=None, metavar="FOLDER_OR_HUB_ID",
                   help=f"a model folder or Hub id (default: the bundled {BUNDLED_MODEL} of this package's "
                        "repository checkout, found from any working folder, never downloaded)")
    d.add_argument("--prompt", default="The json module", help="text to continue (default: %(default)r)")
    d.add_argument("--question", default="What does the json module do?",
                   help="the chat turn's user message (default: %(default)r)")
    d.add_argument("--max-new-tokens", type=int, default=24, metavar="N",
                   help="tokens generated for the prompt, the picture's answer and the chat reply each "
                        "(default: %(default)s)")
    b = sub.add_parser("bench", help="a quick timing of the model on this machine (prefill, decode); writes nothing",
                       description="Time a model with random weights built in memory: prefill tokens/s, and decode "
                                   "tokens/s with the dynamic and the static cache. Nothing is written to disk.")
    b.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    b.add_argument("--prefill", default=None, help="prompt lengths, e.g. 2048,8192 (default: 2048,8192 on "
                                                   "cuda, 32 on cpu)")
    b.add_argument("--batches", default=None, help="decode batch sizes, e.g. 1,8 (default: 1,8 on cuda, 1 on cpu)")
    b.add_argument("--new-tokens", type=int, default=None, metavar="N",
                   help="decode steps timed per batch (default: 32 on cuda, 4 on cpu)")
    p = sub.add_parser("plan", help="print a device_map and the memory per GPU for N GPUs (no weights read)",
                       description="Build the model on the meta device and print where its weights go on N GPUs: "
                                   "layers per GPU, bytes per GPU and, with --offload-experts, the layers whose "
                                   "routed experts stay in host memory (transformers_kimi3.plan_device_map).")
    p.add_argument("--model", default=None, metavar="FOLDER",
                   help="a model folder whose config.json is planned (default: the released Kimi K3 config)")
    p.add_argument("--gpus", type=int, default=8, metavar="N", help="number of GPUs (default: %(default)s)")
    p.add_argument("--gpu-memory", default="140GiB", metavar="SIZE",
                   help="memory of each GPU, e.g. 140GiB for an H200 or 79GiB for an H100 (default: %(default)s)")
    p.add_argument("--reserve", default=None, metavar="FRACTION_OR_SIZE",
                   help="kept free of weights on each GPU for activations and caches: a fraction such as 0.1 or a "
                        "size such as 12GiB (default: 0.1)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host memory the offloaded experts may use, checked when given (e.g. 1.5TiB)")
    p.add_argument("--offload-experts", action="store_true",
                   help="keep some layers' routed experts in host memory when the GPUs cannot hold every weight")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the non-expert weights as loaded (default: %(default)s)")
    return ap


def plan(args):
    from .placement import DEFAULT_RESERVE, plan_device_map

    for flag, value in (("--gpu-memory", args.gpu_memory), ("--host-memory", args.host_memory)):
        if value is not None and value.replace(".", "", 1).isdigit():  # bytes are meant only with a unit here
            raise SystemExit(f"error: {flag} {value}: give a unit, e.g. {value}GiB")
    reserve = DEFAULT_RESERVE if args.reserve is None else args.reserve
    if isinstance(reserve, str):
        try:
            reserve = float(reserve)
        except ValueError:
            pass  # a size such as "12GiB"
    try:
        result = plan_device_map(args.model, gpus=args.gpus, gpu_memory=args.gpu_memory, reserve=reserve,
                                 host_memory=args.host_memory, offload_experts=args.offload_experts,
                                 dtype=getattr(torch, args.dtype))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(result)
    return result


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            demo(args)
        elif args.cmd == "plan":
            plan(args)
        else:
            from .benchmark import main as bench

            bench(args)
    except (ValueError, OSError) as e:  # a bad input or folder (CheckpointError too): its message, not a traceback
        raise SystemExit(f"error: {e}") from e


if __name__ == "__main__":
    main()
