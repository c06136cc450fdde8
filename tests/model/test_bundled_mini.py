"""The bundled kimi-k3-mini (trained weights, MXFP4 experts) on the CPU: a held-out document's perplexity equals the
value recorded for these weights to 1e-4 (fp32; a numerical change anywhere on the text path moves it) and is far
below chance, and a picture question gets an answer in the form it was trained on."""
import json
import math
import os
import re

import pytest
import torch

from kimi3_testing import ROOT

MINI = os.path.join(ROOT, "assets", "kimi-k3-mini")
HELD_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mini_heldout.json")
EXPECTED_PPL = 421.95855  # these weights on HELD_OUT, fp32, CPU


@pytest.fixture(scope="module")
def mini():
    from transformers import AutoProcessor

    from transformers_kimi3 import Kimi3ForConditionalGeneration

    return (Kimi3ForConditionalGeneration.from_pretrained(MINI, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(MINI))


def perplexity(model, ids):
    with torch.no_grad():
        return math.exp(model(input_ids=ids, labels=ids).loss.item())


def test_held_out_perplexity(mini):
    model, processor = mini
    with open(HELD_OUT, encoding="utf-8") as f:
        held_out = json.load(f)
    ids = processor.tokenizer(held_out["text"], return_tensors="pt").input_ids
    assert ids.shape[1] == held_out["tokens"]
    ppl = perplexity(model, ids)
    chance = perplexity(model, torch.randint(3, 7900, ids.shape, generator=torch.Generator().manual_seed(0)))
    # fp32 on the CPU: the recorded value to 1e-4 (thread counts reorder sums by ~1e-7); chance is far worse
    assert ppl == pytest.approx(EXPECTED_PPL, rel=1e-4), ppl
    assert ppl < chance / 50, (ppl, chance)


def test_picture_question_gets_an_answer_in_form(mini):
    from transformers_kimi3.__main__ import red_circle

    model, processor = mini
    messages = [{"role": "user", "content": [{"type": "image", "image": red_circle()},
                                             {"type": "text", "text": "What colour is the circle?"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt", thinking=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    reply = processor.parse_output(out[:, inputs["input_ids"].shape[1]:], prompt=inputs["input_ids"])["content"]
    assert re.fullmatch(r"The circle is [a-z ]+\.", reply.strip()), reply


def test_bundled_folders_generate_with_the_cache_on():
    """Training turns the cache off in the config; the exported folders must not keep that (decoding without it
    recomputes the whole prefix at every step: ~10x slower on the draft)."""
    import json

    for name in ("kimi-k3-mini", "kimi-k3-mini-draft"):
        for file in ("config.json", "generation_config.json"):
            data = json.load(open(os.path.join(ROOT, "assets", name, file)))
            for cfg in (data, data.get("text_config", {})):
                assert cfg.get("use_cache", True) is True, (name, file)
