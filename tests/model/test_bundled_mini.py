"""The bundled kimi-k3-mini (trained weights, MXFP4 experts) on the CPU: held-out-style prose is far more likely
under it than under chance, at the perplexity recorded for these weights, and a picture question gets an answer in
the form it was trained on. A broken path (a layer, the packed experts, the vision tower) moves both."""
import math
import os
import re

import pytest
import torch

from kimi3_testing import ROOT

MINI = os.path.join(ROOT, "assets", "kimi-k3-mini")
# prose in the style of the documentation it read, written for this test (not in its corpus)
PROSE = ("The json module converts Python objects to text and back. Call dumps to turn a dictionary into a string, "
         "and loads to read such a string into a dictionary again. Lists become arrays, and None becomes null. "
         "Pass indent to write each item on a line of its own, which makes the output easier to read.")
EXPECTED_PPL = 256.44  # these weights, fp32, CPU


@pytest.fixture(scope="module")
def mini():
    from transformers import AutoProcessor

    from transformers_kimi3 import Kimi3ForConditionalGeneration

    return (Kimi3ForConditionalGeneration.from_pretrained(MINI, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(MINI))


def perplexity(model, ids):
    with torch.no_grad():
        return math.exp(model(input_ids=ids, labels=ids).loss.item())


def test_prose_perplexity(mini):
    model, processor = mini
    ids = processor.tokenizer(PROSE, return_tensors="pt").input_ids
    ppl = perplexity(model, ids)
    chance = perplexity(model, torch.randint(3, 7900, ids.shape, generator=torch.Generator().manual_seed(0)))
    # fp32 on the CPU: the recorded value to 1 % (threads reorder sums by ~1e-6); chance is orders of magnitude worse
    assert ppl == pytest.approx(EXPECTED_PPL, rel=1e-2), ppl
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
