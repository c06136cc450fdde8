"""MoonViT-V2 vision tower and PatchMergerMLPV2 projector of Kimi K3.

Module and parameter names follow the official checkpoint (`vision_tower.*`, `mm_projector.*`), so the released
tensors load with a plain `load_state_dict`. Images and video chunks of different sizes are packed along the token
axis and described by `grid_thws` (t, h, w in patches); attention never crosses from one item to another.
"""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .configuration_kimi3 import Kimi3VisionConfig


def _validate_inputs(pixel_values, grid_thws, config):
    """Checks the packed input against its grid so mistakes surface here, not as a shape error deep inside."""
    p = config.patch_size
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
        raise ValueError(f"pixel_values must have shape [num_patches, 3, {p}, {p}], got {tuple(pixel_values.shape)}")
    if grid_thws.ndim != 2 or grid_thws.shape[1] != 3 or grid_thws.is_floating_point():
        raise ValueError(f"grid_thws must be an integer tensor of shape [num_items, 3], got "
                         f"{tuple(grid_thws.shape)} {grid_thws.dtype}")
    grids = grid_thws.tolist()
    kh, kw = config.merge_kernel_size
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"grid_thws[{i}] = {[t, h, w]} has a non-positive size")
        if h % kh or w % kw:
            raise ValueError(f"grid_thws[{i}] = {[t, h, w]}: h={h} and w={w} must be multiples of the "
                             f"{kh}x{kw} merge kernel")
        if t > config.init_pos_emb_time:
            raise ValueError(f"grid_thws[{i}] = {[t, h, w]}: t={t} exceeds init_pos_emb_time="
                             f"{config.init_pos_emb_time}; split the video into chunks of at most that many frames")
    total = sum(t * h * w for t, h, w in grids)
    if total != pixel_values.shape[0]:
        raise ValueError(f"grid_thws describes {total} patches but pixel_values holds {pixel_values.shape[0]}")
    return grids


def _sincos_time_embedding(num_frames, dim, device):
    """Fixed 1-D [sin | cos] table over frames, built in fp32 like the official numpy code."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32, device=device) / (dim / 2.0))
    angles = torch.arange(num_frames, dtype=torch.float32, device=device)[:, None] * omega[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def _rope_cos_sin(grids, head_dim, theta, device):
    """cos/sin of the 2-D RoPE angles for every packed token, [L, head_dim/2] in fp32.

    Rotary pairs alternate (column, row) per frequency: pair 2i turns with x * f_i, pair 2i+1 with y * f_i, and the
    same spatial table repeats over the t frames of an item.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32, device=device)[: head_dim // 4] / head_dim))
    angles = []
    for t, h, w in grids:
        y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=device),
                              torch.arange(w, dtype=torch.float32, device=device), indexing="ij")
        xy = torch.stack([x.reshape(-1, 1) * freqs, y.reshape(-1, 1) * freqs], dim=-1)  # [h*w, hd/4, 2]
        angles.append(xy.reshape(h * w, head_dim // 2).repeat(t, 1))
    angles = torch.cat(angles)
    return angles.cos(), angles.sin()


def _apply_rope(x, cos, sin):
    """Rotates interleaved (real, imag) pairs of x [L, heads, head_dim] in fp32, as the official complex product."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs.unbind(-1)
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def _eager_attention(q, k, v):
    """Reference math of the official eager path: scores in the input dtype, softmax in fp32."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _varlen_attention(q, k, v, lengths, implementation):
    """Bidirectional attention inside each packed item; q/k/v are [L, heads, head_dim], the result [L, heads*hd]."""
    attend = _eager_attention if implementation == "eager" else F.scaled_dot_product_attention
    # per item, batch of one [1, heads, len, hd]: the layout every SDPA backend (flash included) accepts
    outputs = [
        attend(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None])[0].transpose(0, 1)
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    return torch.cat(outputs).flatten(-2)


class Kimi3VisionPositionEmbedding(nn.Module):
    """Learnable 2-D table, bilinearly resampled to each item's grid, plus a fixed time table for t > 1."""

    def __init__(self, config: Kimi3VisionConfig):
        super().__init__()
        self.interpolation_mode = config.pos_emb_interpolation_mode
        self.weight = nn.Parameter(
            torch.empty(config.init_pos_emb_height, config.init_pos_emb_width, config.vt_hidden_size)
        )
        nn.init.normal_(self.weight)

    def _spatial(self, h, w):
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        # align_corners stays False (F.interpolate's default), which is what the official table lookup uses
        table = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode=self.interpolation_mode)
        return table[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, x, grids):
        embeddings = []
        for t, h, w in grids:
            spatial = self._spatial(h, w)
            if t > 1:
                time = _sincos_time_embedding(t, spatial.shape[-1], spatial.device).to(spatial.dtype)
                spatial = (spatial[None] + time[:, None]).flatten(0, 1)
            embeddings.append(spatial)
        return x + torch.cat(embeddings)


class Kimi3VisionPatchEmbed(nn.Module):
    def __init__(self, config: Kimi3VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, config.vt_hidden_size, kernel_size=config.patch_size, stride=config.patch_size,
                              bias=config.patch_embed_proj_bias)
        self.pos_emb = Kimi3VisionPositionEmbedding(config)

    def forward(self, pixel_values, grids):
        x = self.proj(pixel_values).flatten(1)
        return self.pos_emb(x, grids)


class Kimi3VisionMLP(nn.Module):
    def __init__(self, config: Kimi3VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.vt_hidden_size, config.vt_intermediate_size, bias=config.linear_bias)
        self.fc1 = nn.Linear(config.vt_intermediate_size, config.vt_hidden_size, bias=config.linear_bias)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.fc1(self.act(self.fc0(x)))


class Kimi3VisionBlock(nn.Module):
    """Pre-norm ViT block. The norms take no eps on purpose: nn.RMSNorm then uses finfo(dtype).eps, as the release."""

    def __init__(self, config: Kimi3VisionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.vt_num_attention_heads
        self.norm0 = nn.RMSNorm(config.vt_hidden_size)
        self.norm1 = nn.RMSNorm(config.vt_hidden_size)
        self.wqkv = nn.Linear(config.vt_hidden_size, 3 * config.qkv_hidden_size, bias=config.attn_bias)
        self.wo = nn.Linear(config.qkv_hidden_size, config.vt_hidden_size, bias=config.attn_bias)
        self.mlp = Kimi3VisionMLP(config)

    def forward(self, x, rope_cos, rope_sin, lengths):
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        q, k = _apply_rope(q, rope_cos, rope_sin), _apply_rope(k, rope_cos, rope_sin)
        x = x + self.wo(_varlen_attention(q, k, v, lengths, self.config._attn_implementation))
        return x + self.mlp(self.norm1(x))


class Kimi3VisionEncoder(nn.Module):
    """Holds the blocks and the final norm under the official names; `Kimi3VisionModel.forward` runs them."""

    def __init__(self, config: Kimi3VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Kimi3VisionBlock(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = nn.RMSNorm(config.vt_hidden_size)


def _merge_2x2_mean_over_time(x, grids, merge_kernel_size):
    """sd2_tpool: groups each kh x kw neighbourhood (row-major inside the group) and averages over frames."""
    kh, kw = merge_kernel_size
    merged = []
    for item, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids):
        groups = item.view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5).mean(dim=0)
        merged.append(groups.reshape((h // kh) * (w // kw), kh * kw, -1))
    return torch.cat(merged)


class Kimi3VisionModel(nn.Module):
    """MoonViT-V2: patch embedding, position tables, 2-D RoPE ViT blocks and the 2x2 temporal-pooling merge.

    `forward(pixel_values [N, 3, p, p], grid_thws [n, 3]) -> [sum_i h_i*w_i/4, 4, hidden]`. Set
    `gradient_checkpointing = True` to recompute the blocks in the backward pass while training.
    Attention uses torch SDPA unless `config._attn_implementation == "eager"`.
    """

    def __init__(self, config: Kimi3VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = Kimi3VisionPatchEmbed(config)
        self.encoder = Kimi3VisionEncoder(config)
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        grids = _validate_inputs(pixel_values, grid_thws, self.config)
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype), grids)
        rope_cos, rope_sin = _rope_cos_sin(grids, self.config.head_dim, self.config.rope_theta, x.device)
        lengths = [t * h * w for t, h, w in grids]
        for block in self.encoder.blocks:
            if self.gradient_checkpointing and self.training:
                x = self._gradient_checkpointing_func(block.__call__, x, rope_cos, rope_sin, lengths)
            else:
                x = block(x, rope_cos, rope_sin, lengths)
        x = self.encoder.final_layernorm(x)
        return _merge_2x2_mean_over_time(x, grids, self.config.merge_kernel_size)


class Kimi3MultiModalProjector(nn.Module):
    """PatchMergerMLPV2: concatenated 2x2 group -> Linear -> exact GELU -> Linear -> RMSNorm(projector_ln_eps)."""

    def __init__(self, config: Kimi3VisionConfig):
        super().__init__()
        kh, kw = config.merge_kernel_size
        self.input_size = config.mm_hidden_size * kh * kw
        self.proj = nn.Sequential(
            nn.Linear(self.input_size, self.input_size, bias=False),
            nn.GELU(),
            nn.Linear(self.input_size, config.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(image_features.reshape(image_features.shape[0], self.input_size)))


__all__ = ["Kimi3VisionModel", "Kimi3MultiModalProjector", "Kimi3VisionBlock", "Kimi3VisionPositionEmbedding"]
