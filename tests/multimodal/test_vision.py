"""MoonViT-V2 tower and projector against Moonshot's own outputs (oracle A) plus packing and error behaviour."""

import copy
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

from safetensors.torch import load_file

from transformers_kimi3.configuration_kimi3 import Kimi3Config
from transformers_kimi3.vision import Kimi3MultiModalProjector, Kimi3VisionModel

from kimi3_testing import ORACLE_A  # noqa: E402

ORACLE = Path(ORACLE_A)
# The official fp32 code and an independent fp64 implementation agree to ~5e-7 here (oracle README section 5).
REL_TOL = 1e-4

pytestmark = pytest.mark.skipif(not (ORACLE / "model.safetensors").exists(), reason=f"oracle not found at {ORACLE}")


def rel_err(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module")
def oracle():
    config = Kimi3Config.from_pretrained(ORACLE).vision_config
    weights = load_file(ORACLE / "model.safetensors")
    tower, projector = Kimi3VisionModel(config), Kimi3MultiModalProjector(config)
    for module, prefix in ((tower, "vision_tower."), (projector, "mm_projector.")):
        # bf16 storage -> fp32 compute, as the oracle was produced
        module.load_state_dict({k[len(prefix):]: v.float() for k, v in weights.items() if k.startswith(prefix)},
                               strict=True)
    return tower.eval(), projector.eval(), load_file(ORACLE / "inputs_and_logits.safetensors")


def random_pixels(grid, seed=0):
    t, h, w = grid
    return torch.randn(t * h * w, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def test_parameter_names_match_the_checkpoint(oracle):
    tower, projector, _ = oracle
    names = {k for k in load_file(ORACLE / "model.safetensors") if k.startswith(("vision_tower.", "mm_projector."))}
    ours = {f"vision_tower.{k}" for k in tower.state_dict()} | {f"mm_projector.{k}" for k in projector.state_dict()}
    assert ours == names


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_tower_and_projector_match_official_outputs(oracle, attn_implementation):
    tower, projector, ref = oracle
    tower.config._attn_implementation = attn_implementation
    try:
        with torch.no_grad():
            features = tower(ref["mm_pixel_values"], ref["mm_grid_thws"])
            projected = projector(features)
    finally:
        tower.config._attn_implementation = None
    assert features.shape == ref["mm_vision_tower_out"].shape == (6, 4, 32)
    assert projected.shape == ref["mm_projector_out"].shape == (6, 128)
    assert rel_err(features, ref["mm_vision_tower_out"]) < REL_TOL
    assert rel_err(projected, ref["mm_projector_out"]) < REL_TOL


def test_packed_items_equal_each_alone(oracle):
    tower, projector, _ = oracle
    # 8x8 uses the table as is, 4x6 and 10x12 resample it, t=2 adds the time table
    grids = [(1, 4, 6), (1, 8, 8), (2, 10, 12), (1, 6, 4)]
    pixels = [random_pixels(g, seed=i) for i, g in enumerate(grids)]
    with torch.no_grad():
        packed = tower(torch.cat(pixels), torch.tensor(grids))
        alone = torch.cat([tower(p, torch.tensor([g])) for p, g in zip(pixels, grids)])
        assert projector(packed).shape == (sum(h * w // 4 for _, h, w in grids), 128)
    assert packed.shape == (sum(h * w // 4 for _, h, w in grids), 4, 32)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_video_time_embedding(oracle):
    tower, _, _ = oracle
    frame = random_pixels((1, 4, 6))
    with torch.no_grad():
        still = tower.patch_embed(frame, [(1, 4, 6)])
        video = tower.patch_embed(torch.cat([frame, frame]), [(2, 4, 6)])
        merged = tower(torch.cat([frame, frame]), torch.tensor([[2, 4, 6]]))
    dim = still.shape[-1]
    omega = 1.0 / 10000 ** (np.arange(dim // 2) / (dim / 2))
    table = torch.tensor(np.array([np.concatenate([np.sin(t * omega), np.cos(t * omega)]) for t in (0, 1)]), dtype=torch.float32)
    torch.testing.assert_close(video.view(2, 24, dim) - still, table[:, None].expand(2, 24, dim), rtol=0, atol=1e-5)
    assert merged.shape == (6, 4, 32) and torch.isfinite(merged).all()


def test_gradient_checkpointing_gives_the_same_gradients(oracle):
    tower = copy.deepcopy(oracle[0]).train()
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    pixels = random_pixels((1, 28, 1))

    def grads(checkpointing):
        tower.zero_grad()
        tower.gradient_checkpointing = checkpointing
        tower(pixels, grid).square().sum().backward()
        return [p.grad.clone() for p in tower.parameters()]

    for plain, checkpointed in zip(grads(False), grads(True)):
        torch.testing.assert_close(plain, checkpointed)


def test_bfloat16_runs_with_dtype_dependent_norm_eps(oracle):
    tower, _, ref = oracle
    assert all(m.eps is None for m in tower.modules() if isinstance(m, torch.nn.RMSNorm))
    with torch.no_grad():
        out = copy.deepcopy(tower).to(torch.bfloat16)(ref["mm_pixel_values"], ref["mm_grid_thws"])
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref["mm_vision_tower_out"]) < 0.1


@pytest.mark.parametrize("pixels, grid, message", [
    (random_pixels((1, 4, 6))[:20], [[1, 4, 6]], "describes 24 patches but pixel_values holds 20"),
    (random_pixels((1, 3, 6)), [[1, 3, 6]], "h=3 and w=6 must be multiples"),
    (random_pixels((1, 4, 6))[..., :7], [[1, 4, 6]], r"shape \[num_patches, 3, 14, 14\], got \(24, 3, 14, 7\)"),
    (random_pixels((5, 2, 2)), [[5, 2, 2]], "t=5 exceeds init_pos_emb_time=4"),
    (random_pixels((1, 2, 2)), [[1, 2]], r"shape \[num_items, 3\]"),
])
def test_bad_inputs_raise_value_error(oracle, pixels, grid, message):
    with pytest.raises(ValueError, match=message):
        oracle[0](pixels, torch.tensor(grid))
