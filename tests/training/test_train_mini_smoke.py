"""The CPU smoke run of examples/train_kimi3_mini.py (`--smoke`: a corpus of a few stdlib modules' docstrings, a
768-id K3 tokenizer, a 0.3 M-parameter K3 with every component and its draft, a few steps per phase).

Three runs of the script in subprocesses: A does everything in one invocation (prepare, five phases, export); B runs
the text phase with a budget of 3 steps per invocation, so it stops with a checkpoint at step 3, and is run again,
which resumes at step 3 and finishes. Checked: the text loss falls on the repeated batch, B's resumed text phase
equals A's uninterrupted one (every loss and every weight, bit for bit), and A's exported folders (official layout,
MXFP4 experts) load (the mini model through the Auto classes, the text-only draft through `Kimi3ForCausalLM`, since
Transformers maps its "kimi_linear" type to its own class) and generate, with and without an image.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from kimi3_testing import once_per_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_kimi3_mini.py")


def _start(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "kernels"),
                                           os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, SCRIPT, *args, "--smoke"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc, expected_rc):
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == expected_rc, out[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs, once per test run (kimi3_testing.once_per_run): a second pytest-xdist worker that gets some of
    this file's tests reads their folders and output instead of training again."""
    def make(folder):
        a, b = folder / "uninterrupted", folder / "resumed"
        a.mkdir(), b.mkdir()
        whole = _start("all", "--work", str(a))
        first = _start("all", "--work", str(b), "--phases", "text", "--max-steps-per-call", "3")
        (folder / "paused.txt").write_text(_finish(first, 3))
        (folder / "resumed.txt").write_text(_finish(_start("train", "--work", str(b), "--phases", "text"), 0))
        _finish(whole, 0)

    folder = once_per_run(tmp_path_factory, "train_mini_smoke", make)
    return (folder / "uninterrupted", folder / "resumed", (folder / "paused.txt").read_text(),
            (folder / "resumed.txt").read_text())


def _summary(work, phase):
    with open(os.path.join(work, "phases", phase, "summary.json")) as f:
        return json.load(f)


def test_text_loss_falls_on_the_repeated_batch(runs):
    losses = _summary(runs[0], "text")["losses"]
    assert len(losses) == 6
    assert losses[-1] < losses[1] - 0.5, losses  # step 1 runs at the warm-up's learning rate 0


def test_resume_continues_from_the_checkpoint_with_identical_results(runs):
    a, b, paused, resumed = runs
    assert "paused at step 3 of 6" in paused
    assert os.path.isdir(os.path.join(b, "phases", "text", "checkpoint-3")) or "text: done" in resumed
    assert _summary(b, "text")["losses"] == _summary(a, "text")["losses"]
    wa = load_file(os.path.join(a, "phases", "text", "final", "model.safetensors"))
    wb = load_file(os.path.join(b, "phases", "text", "final", "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_export_loads_and_generates(runs):
    import transformers_kimi3  # noqa: F401  (registers kimi_k3)
    from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    from transformers_kimi3 import Kimi3ForCausalLM

    folder = os.path.join(runs[0], "export", "kimi-k3-mini")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    shards = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    keys = [k for n in shards for k in safe_open(os.path.join(folder, n), "pt").keys()]
    assert any(k.endswith("experts.0.w1.weight_packed") for k in keys)

    model = AutoModelForCausalLM.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, thinking=False, tokenize=False)
    inputs = processor(text=prompt, images=[Image.new("RGB", (150, 100), (200, 30, 30))], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 4
    text = processor.tokenizer("The module", return_tensors="pt")
    assert model.generate(**text, max_new_tokens=3, do_sample=False).shape[1] >= text["input_ids"].shape[1] + 1

    draft_folder = os.path.join(runs[0], "export", "kimi-k3-mini-draft")
    draft = Kimi3ForCausalLM.from_pretrained(draft_folder)  # "kimi_linear" is Transformers' own Auto type
    assert draft.config.vocab_size == model.config.text_config.vocab_size
    assert AutoTokenizer.from_pretrained(draft_folder).get_vocab() == processor.tokenizer.get_vocab()
    assert draft.generate(**text, max_new_tokens=3, do_sample=False).shape[1] >= text["input_ids"].shape[1] + 1
