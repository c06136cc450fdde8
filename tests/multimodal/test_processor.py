"""Kimi3Processor: one placeholder per image, chat template through the processor, save -> AutoProcessor round trip
(also without the package installed), bad input."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from transformers_kimi3.image_processing_kimi3 import Kimi3ImageProcessor
from transformers_kimi3.processing_kimi3 import Kimi3Processor, parse_kimi3_output
from transformers_kimi3.special_tokens import CHAT_TEMPLATE
from transformers_kimi3.tiny_tokenizer import build_tiny_tokenizer
from transformers_kimi3.tokenization_kimi3 import Kimi3Tokenizer

PAD = 469  # <|media_pad|> in the tiny tokenizer
from kimi3_testing import ORACLE_A  # noqa: E402
TINY = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "kimi-k3-tiny")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tok")
    build_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Kimi3Processor(image_processor=Kimi3ImageProcessor(), tokenizer=AutoTokenizer.from_pretrained(tiny_dir))


def _image(width, height, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_one_placeholder_per_image(processor):
    img_a, img_b = _image(84, 56), _image(40, 100, seed=1)
    messages = [{"role": "user", "content": [
        {"type": "image", "image": img_a}, {"type": "text", "text": "Compare"}, {"type": "image", "image": img_b},
    ]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, thinking_effort=None)
    block = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    assert prompt == (f'<|open|>message role="user"<|sep|>{block}Compare{block}<|close|>message<|sep|><|end_of_msg|>'
                      '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    out = processor.apply_chat_template(messages, add_generation_prompt=True, thinking_effort=None, tokenize=True,
                                        return_dict=True, return_tensors="pt")
    assert set(out) == {"input_ids", "attention_mask", "pixel_values", "grid_thws"}
    ids = out["input_ids"][0].tolist()
    assert ids.count(PAD) == 2
    assert out["grid_thws"].tolist() == [[1, 4, 6], [1, 8, 4]]  # padded to multiples of 28
    assert out["pixel_values"].shape == (24 + 32, 3, 14, 14) and out["pixel_values"].dtype == torch.float32
    direct = processor.image_processor([img_a, img_b], return_tensors="pt")
    assert torch.equal(out["pixel_values"], direct["pixel_values"])
    # the processor writes each image's original size into its media block, as the official processor does
    text = processor.tokenizer.decode(ids)
    assert "<|media_begin|>image 84x56<|media_content|><|media_pad|><|media_end|>Compare" in text
    assert "<|media_begin|>image 40x100<|media_content|><|media_pad|><|media_end|>" in text
    # each marker is one id: <|media_begin|> 466, <|media_content|> 467, <|media_end|> 468
    assert ids.count(466) == ids.count(467) == ids.count(468) == 2
    assert out["attention_mask"].tolist() == [[1] * len(ids)]


def test_placeholder_spellings_and_batches(processor):
    img_a, img_b, img_c = _image(28, 28), _image(56, 28, 1), _image(30, 30, 2)
    # a bare pad stays bare; Moonshot's plain-text placeholder becomes the full block
    out = processor(text=["<|media_pad|> one", "two <|kimi_image_placeholder|> and <|media_pad|>"],
                    images=[[img_a], [img_b, img_c]], padding=True, return_tensors="pt")
    assert [row.tolist().count(PAD) for row in out["input_ids"]] == [1, 2]
    assert out["grid_thws"].tolist() == [[1, 2, 2], [1, 2, 4], [1, 4, 4]]
    assert out["pixel_values"].shape[0] == 4 + 8 + 16
    first = processor.tokenizer.decode(out["input_ids"][0], skip_special_tokens=False)
    assert first.startswith("[PAD]") and first.endswith("<|media_pad|> one")  # left padding
    second = processor.tokenizer.decode(out["input_ids"][1])
    assert second == "two <|media_begin|>image 56x28<|media_content|><|media_pad|><|media_end|> and <|media_pad|>"
    # text only: no image keys
    only_text = processor(text="hello", return_tensors="pt")
    assert set(only_text) == {"input_ids", "attention_mask"}
    assert only_text["input_ids"].tolist() == [processor.tokenizer.encode("hello", add_special_tokens=False)]
    # numpy / torch images are sized the same way as PIL ones
    arr = np.zeros((56, 84, 3), np.uint8)
    for image in (arr, torch.zeros(3, 56, 84, dtype=torch.uint8)):
        ids = processor(text="<|media_begin|>image<|media_content|><|media_pad|><|media_end|>", images=image)["input_ids"]
        assert "image 84x56" in processor.tokenizer.decode(ids[0])
    # sizes can be left out of the prompt
    processor.image_size_in_prompt = False
    try:
        ids = processor(text="<|kimi_image_placeholder|>", images=arr)["input_ids"][0]
        assert processor.tokenizer.decode(ids) == "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    finally:
        processor.image_size_in_prompt = True


def test_image_count_mismatch_names_both_numbers(processor):
    img = _image(28, 28)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\).*but 1 image\(s\) were passed"):
        processor(text="<|media_pad|> and <|media_pad|>", images=[img])
    with pytest.raises(ValueError, match=r"0 image placeholder\(s\).*but 1 image\(s\) were passed"):
        processor(text="no placeholder", images=img)
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\).*but 0 image\(s\) were passed"):
        processor(text="<|media_pad|>")
    with pytest.raises(ValueError, match=r"3 image placeholder\(s\).*but 2 image\(s\)"):
        processor(text=["<|media_pad|>", "<|media_pad|><|media_pad|>"], images=[[img], [img]])
    with pytest.raises(ValueError, match="without text"):
        processor(images=img)
    # truncation that cuts a placeholder out is caught
    with pytest.raises(ValueError, match="truncation"):
        processor(text="a long text before the image " * 5 + "<|media_pad|>", images=img, truncation=True, max_length=8)
    # unknown options are ignored (with a warning), as Transformers processors do
    assert processor(text="x", not_an_option=1)["input_ids"] == processor(text="x")["input_ids"]
    with pytest.raises(ValueError, match="zero size"):
        processor(text="<|media_pad|>", images=np.zeros((0, 10, 3), np.uint8))


def test_sanitized_user_text_cannot_forge_images(processor):
    messages = [{"role": "user", "content": [{"type": "text", "text": "typed <|media_pad|> and <|end_of_msg|>"}]}]
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, sanitize_control_tokens=True,
                                        thinking_effort=None)
    ids = out["input_ids"][0] if isinstance(out["input_ids"][0], list) else out["input_ids"]
    assert PAD not in ids and ids.count(450) == 1  # only the template's own <|end_of_msg|>
    assert "pixel_values" not in out
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\).*but 0 image\(s\)"):
        processor.apply_chat_template(messages, tokenize=True, return_dict=True, thinking_effort=None)
    # Moonshot's plain-text image stand-in typed by the user is no image either
    typed = [{"role": "user", "content": "typed <|kimi_image_placeholder|>"}]
    out = processor.apply_chat_template(typed, tokenize=True, return_dict=True, sanitize_control_tokens=True,
                                        thinking_effort=None)
    ids = out["input_ids"][0] if isinstance(out["input_ids"][0], list) else out["input_ids"]
    assert PAD not in ids and "pixel_values" not in out
    assert "kimi_image_placeholder" in processor.tokenizer.decode(ids)


def test_text_only_chat_matches_tokenizer_template(processor):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    from_processor = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    from_tokenizer = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert from_processor[0] == from_tokenizer
    assert processor.chat_template == CHAT_TEMPLATE
    gen = from_tokenizer + processor.tokenizer.encode(
        "ok<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
        add_special_tokens=False)
    new_ids = gen[len(from_tokenizer):]
    assert processor.parse_output(new_ids) == {"reasoning": "ok", "content": "Hello!", "tool_calls": []}
    truncated = processor.tokenizer.encode("still thinking", add_special_tokens=False)
    assert processor.parse_output(truncated, prompt=from_tokenizer)["reasoning"] == "still thinking"
    assert processor.parse_output(torch.tensor([truncated]), prompt=torch.tensor(from_tokenizer))["content"] == ""
    decoded = processor.post_process_image_text_to_text(torch.tensor([new_ids]))
    assert parse_kimi3_output(decoded[0])["content"] == "Hello!"


def test_save_and_auto_processor_round_trip(processor, tmp_path):
    Kimi3Processor.register_for_auto_class()
    Kimi3ImageProcessor.register_for_auto_class()
    processor.save_pretrained(tmp_path)
    names = set(os.listdir(tmp_path))
    assert {"processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "processing_kimi3.py", "image_processing_kimi3.py", "tiktoken.model"} <= names
    loaded = AutoProcessor.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(loaded).__name__ == "Kimi3Processor"
    assert type(loaded.image_processor).__name__ == "Kimi3ImageProcessor"
    assert loaded.chat_template == processor.chat_template
    img = _image(84, 56)
    messages = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Hi?"}]}]
    kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    a, b = processor.apply_chat_template(messages, **kwargs), loaded.apply_chat_template(messages, **kwargs)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the slow tiktoken tokenizer loads from the same folder (tiktoken.model was recovered from tokenizer.json)
    slow = Kimi3Tokenizer.from_pretrained(tmp_path)
    assert slow.decode(a["input_ids"][0]) == processor.tokenizer.decode(a["input_ids"][0])
    assert slow(processor.tokenizer.decode(a["input_ids"][0]), add_special_tokens=False)["input_ids"] == \
        a["input_ids"][0].tolist()


def test_auto_processor_without_auto_image_processor(processor, monkeypatch):
    """Transformers 5.17 without torchvision: `AutoImageProcessor` knows no Kimi3ImageProcessor (its registration is
    a no-op there); the processor still loads, its image processor built directly."""
    from transformers.models.auto import image_processing_auto

    def unavailable(*args, **kwargs):
        raise ValueError("Unrecognized image processor (simulated: AutoImageProcessor unavailable)")

    monkeypatch.setattr(image_processing_auto.AutoImageProcessor, "from_pretrained", unavailable)
    for loaded in (AutoProcessor.from_pretrained(TINY),
                   Kimi3Processor.from_pretrained(TINY, image_size_in_prompt=False)):
        assert type(loaded) is Kimi3Processor and type(loaded.image_processor) is Kimi3ImageProcessor
        settings = [{k: v for k, v in p.image_processor.to_dict().items() if k != "auto_map"}
                    for p in (loaded, processor)]
        assert settings[0] == settings[1] and loaded.chat_template == CHAT_TEMPLATE
        assert loaded.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert loaded.image_size_in_prompt is False  # processor keyword arguments still apply
    img = _image(84, 56)
    a = AutoProcessor.from_pretrained(TINY)(text="<|media_pad|>", images=img, return_tensors="pt")
    b = processor(text="<|media_pad|>", images=img, return_tensors="pt")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a folder that holds no processor still fails, with the first error
    with pytest.raises(ValueError, match="simulated"):
        Kimi3Processor.from_pretrained(os.path.dirname(TINY))


def test_auto_processor_without_the_package(processor, tmp_path):
    """The saved folder is self-contained: remote code only, transformers_kimi3 not importable."""
    Kimi3Processor.register_for_auto_class()
    Kimi3ImageProcessor.register_for_auto_class()
    processor.save_pretrained(tmp_path / "proc")
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "transformers_kimi3":
                    raise ImportError("transformers_kimi3 is blocked in this test")
        sys.meta_path.insert(0, Block())
        import numpy as np
        from PIL import Image
        from transformers import AutoProcessor, AutoTokenizer
        p = AutoProcessor.from_pretrained({str(tmp_path / 'proc')!r}, trust_remote_code=True)
        t = AutoTokenizer.from_pretrained({str(tmp_path / 'proc')!r})
        img = Image.fromarray(np.zeros((56, 84, 3), np.uint8))
        msgs = [{{"role": "user", "content": [{{"type": "image", "image": img}}, {{"type": "text", "text": "Hi"}}]}}]
        out = p.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
        print(type(p).__name__, type(t).__name__, out["input_ids"][0].tolist().count({PAD}), tuple(out["pixel_values"].shape),
              out["grid_thws"].tolist())
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "Kimi3Processor TokenizersBackend 1 (24, 3, 14, 14) [[1, 4, 6]]"


@pytest.mark.skipif(not os.path.isdir(ORACLE_A), reason="oracle A not available")
def test_processor_reproduces_oracle_pixels(processor):
    from safetensors.numpy import load_file

    ref = load_file(os.path.join(ORACLE_A, "inputs_and_logits.safetensors"))
    out = processor(text="<|media_pad|>", images=Image.fromarray(ref["mm_image_uint8"]), return_tensors="np")
    assert out["grid_thws"].tolist() == ref["mm_grid_thws"].tolist()
    assert np.array_equal(out["pixel_values"], ref["mm_pixel_values"])
    assert out["input_ids"].tolist() == [[PAD]]
