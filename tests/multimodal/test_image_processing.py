"""Kimi3ImageProcessor: exact parity with the official preprocessing (oracle A), packing, budgets, errors, I/O."""

import importlib.util
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import transformers_kimi3  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from PIL import Image
from safetensors.torch import load_file

from transformers_kimi3.image_processing_kimi3 import Kimi3ImageProcessor

from kimi3_testing import ORACLE_A  # noqa: E402

ORACLE = Path(ORACLE_A)
needs_oracle = pytest.mark.skipif(not (ORACLE / "inputs_and_logits.safetensors").exists(),
                                  reason=f"oracle not found at {ORACLE}")


@pytest.fixture(scope="module")
def ref():
    return load_file(ORACLE / "inputs_and_logits.safetensors")


@pytest.fixture(scope="module")
def processor():
    return Kimi3ImageProcessor()


def rgb(height, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def png_bytes(array):
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


@needs_oracle
@pytest.mark.parametrize("kind", ["numpy_hwc", "pil", "torch_chw", "torch_hwc", "float01", "png_bytes", "list"])
def test_oracle_image_gives_official_pixels_exactly(processor, ref, kind):
    image = ref["mm_image_uint8"].numpy()
    inputs = {
        "numpy_hwc": image, "pil": Image.fromarray(image), "torch_chw": torch.from_numpy(image).permute(2, 0, 1),
        "torch_hwc": torch.from_numpy(image), "float01": image / 255.0, "png_bytes": png_bytes(image),
        "list": [image],
    }[kind]
    out = processor(inputs)
    assert out["pixel_values"].dtype == torch.float32 and out["grid_thws"].dtype == torch.int64
    assert torch.equal(out["grid_thws"], ref["mm_grid_thws"])
    assert torch.equal(out["pixel_values"], ref["mm_pixel_values"])


def test_images_of_different_sizes_pack_like_each_alone(processor):
    images = [rgb(56, 84, 0), rgb(100, 37, 1), rgb(300, 200, 2)]
    packed = processor(images)
    alone = [processor(image) for image in images]
    assert torch.equal(packed["pixel_values"], torch.cat([a["pixel_values"] for a in alone]))
    assert packed["grid_thws"].tolist() == [[1, 4, 6], [1, 8, 4], [1, 22, 16]]
    assert processor.num_image_features(packed["grid_thws"]) == [6, 8, 88]
    assert [processor.get_number_of_image_features(*image.shape[:2]) for image in images] == [6, 8, 88]


def test_padding_is_zero_pixels_right_and_bottom(processor):
    out = processor(np.full((30, 29, 3), 255, np.uint8))
    assert out["grid_thws"].tolist() == [[1, 4, 4]]
    pixels = out["pixel_values"].view(4, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 56, 56)
    assert (pixels[:, :30, :29] == 1).all() and (pixels[:, 30:] == -1).all() and (pixels[:, :, 29:] == -1).all()


def test_gray_image_is_replicated_to_rgb(processor):
    gray = rgb(28, 28)[..., 0]
    assert torch.equal(processor(gray)["pixel_values"], processor(np.repeat(gray[..., None], 3, 2))["pixel_values"])


@pytest.mark.parametrize("limit, size, grid", [
    (65536, (3000, 9000), [1, 148, 444]),  # area budget: scale sqrt(65536 / (642 * 214)) -> 6216 x 2072 px
    (1024, (900, 2700), [1, 20, 56]),  # scale sqrt(1024 / (192 * 64)) -> 779 x 259 px, padded to 784 x 280
    (65536, (20000, 100), [1, 512, 4]),  # per-side limit: 512 patches on the long side
    (65536, (1, 1), [1, 2, 2]),  # tiny images are padded to one merge group
    (4, (41, 41), [1, 4, 4]),  # the area limit counts whole patches: 41 // 14 = 2 per side, so no downscale
])
def test_images_over_budget_are_resized(limit, size, grid):
    processor = Kimi3ImageProcessor(in_patch_limit=limit)
    height, width = size
    t, h, w = grid
    assert processor.get_number_of_image_features(height, width) == h * w // 4
    if height * width > 10**7:  # the full resize of this one costs seconds; its plan is checked above
        return
    out = processor(Image.new("RGB", (width, height), (10, 20, 30)))
    assert out["grid_thws"].tolist() == [grid]
    assert out["pixel_values"].shape == (h * w, 3, 14, 14)


def test_downscale_is_pil_bicubic_then_zero_pad_then_normalise():
    image = rgb(100, 300)
    out = Kimi3ImageProcessor(in_patch_limit=16)(image)  # scale sqrt(16 / (21 * 7)) -> 98 x 32 px
    resized = np.asarray(Image.fromarray(image).resize((98, 32), resample=Image.Resampling.BICUBIC))
    padded = np.zeros((56, 112, 3), np.uint8)
    padded[:32, :98] = resized
    expected = (torch.from_numpy(padded).float() / 255 - 0.5) / 0.5
    expected = expected.view(4, 14, 8, 14, 3).permute(0, 2, 4, 1, 3).reshape(32, 3, 14, 14)
    assert out["grid_thws"].tolist() == [[1, 4, 8]]
    torch.testing.assert_close(out["pixel_values"], expected, rtol=0, atol=1e-6)


def test_call_time_override_of_the_budget(processor):
    assert processor(rgb(280, 280), in_patch_limit=100)["grid_thws"].tolist() == [[1, 10, 10]]
    assert processor(rgb(280, 280))["grid_thws"].tolist() == [[1, 20, 20]]
    with pytest.raises(TypeError, match="do_resize"):
        processor(rgb(28, 28), do_resize=False)


def test_video_is_split_into_chunks_of_four_frames(processor):
    frames = [rgb(56, 84, seed) for seed in range(6)]
    out = processor(videos=[frames])
    assert out["grid_thws"].tolist() == [[4, 4, 6], [2, 4, 6]]
    per_frame = torch.cat([processor(frame)["pixel_values"] for frame in frames])
    assert torch.equal(out["pixel_values"], per_frame)
    assert processor.num_image_features(out["grid_thws"]) == [6, 6]
    as_array = processor(videos=np.stack(frames))
    assert torch.equal(as_array["pixel_values"], out["pixel_values"])
    both = processor(images=rgb(28, 56), videos=[frames[:2], frames[2:3]])
    assert both["grid_thws"].tolist() == [[1, 2, 4], [2, 4, 6], [1, 4, 6]]


def test_video_frames_share_the_first_frame_plan(processor):
    out = processor(videos=[[rgb(56, 84), rgb(100, 100)]])
    assert out["grid_thws"].tolist() == [[2, 4, 6]]


@pytest.mark.parametrize("bad, message", [
    (b"\x89PNG\r\n\x1a\n not really a png", "could not decode"),
    (png_bytes(rgb(40, 40))[:60], "could not decode"),
    (np.zeros((0, 5, 3), np.uint8), "zero size"),
    (Image.new("RGB", (0, 7)), "zero size"),
    (np.zeros((10, 10, 4), np.uint8), "1 .gray. or 3 .RGB. channels"),
    (torch.zeros(2, 10, 10), "1 .gray. or 3 .RGB. channels"),
    (np.full((10, 10, 3), np.nan, np.float32), "NaN"),
    (np.full((10, 10, 3), 2.0), r"float images must lie in \[0, 1\]"),
    (np.zeros((2, 3, 4, 5, 6)), "2 or 3 dimensions"),
    (object(), "unsupported image type"),
])
def test_bad_images_raise_value_error(processor, bad, message):
    with pytest.raises(ValueError, match=message):
        processor(bad)


def test_no_input_raises(processor):
    with pytest.raises(ValueError, match="no images or videos"):
        processor([])


def test_save_and_load_round_trip(tmp_path):
    processor = Kimi3ImageProcessor(in_patch_limit=1024, in_patch_limit_video=8192)
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["in_patch_limit"] == 1024 and saved["image_processor_type"] == "Kimi3ImageProcessor"
    loaded = Kimi3ImageProcessor.from_pretrained(tmp_path)
    assert loaded.to_dict() == processor.to_dict()
    image = rgb(500, 700)
    assert torch.equal(loaded(image)["pixel_values"], processor(image)["pixel_values"])
    assert Kimi3ImageProcessor.from_pretrained(tmp_path, in_patch_limit=64).in_patch_limit == 64


def test_official_media_proc_cfg_layout_loads(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "KimiK25VisionProcessor",
        "media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 4096,
                           "patch_limit_on_one_side": 512, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                           "in_patch_limit_each_frame": 4096, "temporal_merge_kernel_size": 4, "sample_fps": 2.0},
    }))
    processor = Kimi3ImageProcessor.from_pretrained(tmp_path)
    assert processor.in_patch_limit == 4096 and processor.in_patch_limit_each_frame == 4096


@needs_oracle
def test_works_without_torchvision(ref, monkeypatch):
    # a fresh copy of the module loaded as a lone file, as trust_remote_code copies it, with torchvision unimportable
    monkeypatch.setitem(sys.modules, "torchvision", None)
    path = Path(__file__).resolve().parents[2] / "src" / "transformers_kimi3" / "image_processing_kimi3.py"
    spec = importlib.util.spec_from_file_location("kimi3_lone_image_processing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.Kimi3ImageProcessor()(ref["mm_image_uint8"].numpy())
    assert torch.equal(out["pixel_values"], ref["mm_pixel_values"])
