"""Kimi K3 image and video processor (NaViT native resolution), PIL + numpy only.

Reproduces the official `KimiK25VisionProcessor` / `media_utils` pipeline that K3 ships: an aspect-preserving
downscale that keeps an image within `in_patch_limit` patches and `patch_limit_on_one_side` patches per side
(images already inside the budget keep their size; larger ones are resized, never rejected), PIL bicubic resize,
zero padding right/bottom to a multiple of patch_size * merge_kernel_size, `(x/255 - mean) / std`, and row-major
cutting into [num_patches, 3, p, p]. Videos are split into chunks of `temporal_merge_kernel_size` frames; each chunk
is one item of the grid (t <= 4) that the vision tower averages over time.
"""

import io
import math
import os

import numpy as np
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.processing_utils import ImagesKwargs

try:
    import torch
except ImportError:  # the processor itself only needs numpy and PIL
    torch = None

try:
    from PIL import Image, UnidentifiedImageError
except ImportError:
    Image = None


class Kimi3ImageProcessorKwargs(ImagesKwargs, total=False):
    patch_size: int
    merge_kernel_size: int
    in_patch_limit: int
    patch_limit_on_one_side: int
    in_patch_limit_each_frame: int
    in_patch_limit_video: int | None
    temporal_merge_kernel_size: int


_CONFIG_KEYS = ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                "in_patch_limit_each_frame", "in_patch_limit_video", "temporal_merge_kernel_size",
                "image_mean", "image_std")


def _require_pil():
    if Image is None:
        raise ImportError("Kimi3ImageProcessor needs Pillow: pip install pillow")


def _open_encoded(source):
    """Decodes file bytes or a path; load() forces the full decode so truncated files fail here."""
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"could not decode the image ({type(err).__name__}: {err})") from err
    return image


def _array_to_uint8(array):
    """Accepts uint8, other integers in 0..255, or floats in [0, 1] (rounded to the nearest 1/255 step)."""
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"unsupported image dtype {array.dtype}; use uint8 or floats in [0, 1]")
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise ValueError("image contains NaN or infinite values")
        if array.min() < 0 or array.max() > 1:
            raise ValueError(f"float images must lie in [0, 1], got values in [{array.min()}, {array.max()}]; "
                             "pass uint8 for 0..255 data")
        return np.round(array * 255).astype(np.uint8)
    if array.min() < 0 or array.max() > 255:
        raise ValueError(f"integer images must lie in 0..255, got values in [{array.min()}, {array.max()}]")
    return array.astype(np.uint8)


def _array_to_pil(array, channels_first):
    """numpy arrays default to HWC and torch tensors to CHW; the other layout is recognised by its channel axis."""
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3:
        raise ValueError(f"an image must have 2 or 3 dimensions, got shape {array.shape}")
    layouts = ("chw", "hwc") if channels_first else ("hwc", "chw")
    layout = next((lay for lay in layouts if array.shape[0 if lay == "chw" else 2] in (1, 3)), None)
    if layout is None:
        raise ValueError(f"an image must have 1 (gray) or 3 (RGB) channels, got shape {array.shape}; "
                         "convert RGBA or other modes to RGB first")
    if layout == "chw":
        array = array.transpose(1, 2, 0)
    if 0 in array.shape:
        raise ValueError(f"image has zero size: shape {array.shape}")
    array = _array_to_uint8(np.ascontiguousarray(array))
    return Image.fromarray(np.repeat(array, 3, axis=2) if array.shape[2] == 1 else array)


def _to_pil(image):
    """Any supported single image -> RGB PIL image (the official code converts every input with .convert('RGB'))."""
    _require_pil()
    if isinstance(image, (bytes, bytearray, str, os.PathLike)):
        image = _open_encoded(image)
    elif torch is not None and isinstance(image, torch.Tensor):
        image = _array_to_pil(image.detach().cpu().float().numpy() if image.is_floating_point()
                              else image.detach().cpu().numpy(), channels_first=True)
    elif isinstance(image, np.ndarray):
        image = _array_to_pil(image, channels_first=False)
    elif not isinstance(image, Image.Image):
        raise ValueError(f"unsupported image type {type(image).__name__}")
    if image.width == 0 or image.height == 0:
        raise ValueError(f"image has zero size: {image.width}x{image.height}")
    return image.convert("RGB")


def _is_batch_array(x):
    return (isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor))) and x.ndim == 4


def _flatten_images(images):
    """Nested lists (per-sample batches) and 4-D arrays [N, ...] become a flat list of single images."""
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in _flatten_images(item)]
    return list(images) if _is_batch_array(images) else [images]


def _list_videos(videos):
    """One video is a 4-D array or a list of frames; a list of such videos is several videos."""
    if _is_batch_array(videos):
        return [list(videos)]
    if isinstance(videos, (list, tuple)) and videos and all(
            isinstance(v, (list, tuple)) or _is_batch_array(v) for v in videos):
        return [list(v) for v in videos]
    return [list(videos)]


class Kimi3ImageProcessor(BaseImageProcessor):
    r"""Image/video processor of Kimi K3 (MoonViT-V2 native resolution).

    Returns a `BatchFeature` with `pixel_values` [num_patches, 3, patch_size, patch_size] (float32) and `grid_thws`
    [num_items, 3] (int64, t/h/w in patches), images first then video chunks, each in input order. Every item
    becomes `h * w / merge_kernel_size**2` features in the language model (see `num_image_features`).

    Args:
        patch_size: side of one ViT patch in pixels.
        merge_kernel_size: side of the spatial merge; padding makes both grid sides multiples of it.
        in_patch_limit: patch budget of one image; larger images are downscaled (aspect kept) to fit.
        patch_limit_on_one_side: most patches along either side.
        in_patch_limit_each_frame: patch budget of one video frame.
        in_patch_limit_video: optional budget of a whole video chunk, shared by its frames.
        temporal_merge_kernel_size: frames per video chunk (at most the tower's `init_pos_emb_time`).
        image_mean, image_std: per-channel normalisation after scaling to [0, 1].
        media_proc_cfg: the official `preprocessor_config.json` layout; its known keys override the above.

    Inputs: PIL images, file bytes or paths, numpy arrays (HWC, or CHW), torch tensors (CHW, or HWC), uint8 or
    floats in [0, 1]; gray images are replicated to RGB. Bad inputs (undecodable bytes, zero size, channel counts
    other than 1 or 3, NaN) raise `ValueError`.
    """

    model_input_names = ["pixel_values", "grid_thws"]
    valid_kwargs = Kimi3ImageProcessorKwargs

    def __init__(self, patch_size=14, merge_kernel_size=2, in_patch_limit=65536, patch_limit_on_one_side=512,
                 in_patch_limit_each_frame=16384, in_patch_limit_video=None, temporal_merge_kernel_size=4,
                 image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), media_proc_cfg=None, **kwargs):
        super().__init__(**kwargs)
        settings = dict(patch_size=patch_size, merge_kernel_size=merge_kernel_size, in_patch_limit=in_patch_limit,
                        patch_limit_on_one_side=patch_limit_on_one_side,
                        in_patch_limit_each_frame=in_patch_limit_each_frame, in_patch_limit_video=in_patch_limit_video,
                        temporal_merge_kernel_size=temporal_merge_kernel_size, image_mean=image_mean,
                        image_std=image_std)
        settings.update({k: v for k, v in (media_proc_cfg or {}).items() if k in _CONFIG_KEYS})
        settings["image_mean"], settings["image_std"] = list(settings["image_mean"]), list(settings["image_std"])
        for key, value in settings.items():
            setattr(self, key, value)

    def resize_plan(self, width, height, patch_limit=None):
        """(new_width, new_height, pad_width, pad_height) of the official NaViT resize for one image or frame."""
        p, side = self.patch_size, self.patch_limit_on_one_side
        patch_limit = self.in_patch_limit if patch_limit is None else patch_limit
        scale = min(1.0, math.sqrt(patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
                    side * p / width, side * p / height)
        new_width = min(max(1, int(width * scale)), side * p)
        new_height = min(max(1, int(height * scale)), side * p)
        factor = p * self.merge_kernel_size
        return new_width, new_height, -new_width % factor, -new_height % factor

    def get_number_of_image_features(self, height, width):
        """Language-model positions one image of this size fills (h * w / merge**2 of its padded grid)."""
        new_width, new_height, pad_width, pad_height = self.resize_plan(width, height)
        factor = self.patch_size * self.merge_kernel_size
        return (new_height + pad_height) // factor * ((new_width + pad_width) // factor)

    def num_image_features(self, grid_thws):
        """Language-model positions per item of `grid_thws` (time is pooled, so t does not count)."""
        return [int(h) * int(w) // self.merge_kernel_size ** 2 for _, h, w in np.asarray(grid_thws).tolist()]

    def _resize_and_pad(self, image, plan):
        new_width, new_height, pad_width, pad_height = plan
        array = np.asarray(image.resize((new_width, new_height), resample=Image.Resampling.BICUBIC))
        return np.pad(array, ((0, pad_height), (0, pad_width), (0, 0)))

    def _patchify(self, frames):
        """[T, H, W, 3] uint8 -> normalised patches [T*H/p*W/p, 3, p, p] and the grid (T, H/p, W/p)."""
        x = (frames / 255.0).astype(np.float32)
        # in place like the official code: the float64 mean/std make numpy round each step once to float32
        x -= np.asarray(self.image_mean)
        x *= 1.0 / np.asarray(self.image_std)
        t, h, w, c = x.shape
        p = self.patch_size
        patches = x.reshape(t, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4).reshape(-1, c, p, p)
        return patches, (t, h // p, w // p)

    def _process_image(self, image):
        image = _to_pil(image)
        return self._patchify(self._resize_and_pad(image, self.resize_plan(image.width, image.height))[None])

    def _process_video_chunk(self, frames):
        """All frames of a chunk take the size planned from its first frame, as the official processor does."""
        frames = [_to_pil(frame) for frame in frames]
        limit = self.in_patch_limit_each_frame
        if self.in_patch_limit_video is not None:
            limit = min(round(self.in_patch_limit_video / len(frames)), limit)
        plan = self.resize_plan(frames[0].width, frames[0].height, limit)
        return self._patchify(np.stack([self._resize_and_pad(frame, plan) for frame in frames]))

    def preprocess(self, images=None, videos=None, return_tensors="pt", **kwargs):
        """Processes `images` (one or a list) and/or `videos` (one or a list; a video is a list of frames or a
        4-D array). Keyword arguments override the processor's settings for this call only."""
        unknown = set(kwargs) - set(_CONFIG_KEYS)
        if unknown:
            raise TypeError(f"unexpected arguments {sorted(unknown)}; accepted: {list(_CONFIG_KEYS)}")
        if kwargs:
            return self.__class__(**{**self.to_dict(), **kwargs}).preprocess(images, videos, return_tensors)
        items = [self._process_image(image) for image in ([] if images is None else _flatten_images(images))]
        for video in [] if videos is None else _list_videos(videos):
            if not video:
                raise ValueError("a video must have at least one frame")
            step = self.temporal_merge_kernel_size
            items += [self._process_video_chunk(video[i:i + step]) for i in range(0, len(video), step)]
        if not items:
            raise ValueError("no images or videos were given")
        data = {
            "pixel_values": np.concatenate([patches for patches, _ in items]),
            "grid_thws": np.array([grid for _, grid in items], dtype=np.int64),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __call__(self, images=None, videos=None, **kwargs):
        return self.preprocess(images, videos, **kwargs)


__all__ = ["Kimi3ImageProcessor"]
