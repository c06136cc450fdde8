"""Checks of values: each source tensor as it is read, each written tensor against a recomputation from the source,
and the logits of the source and output models on random tokens."""

import os

import torch

from transformers_kimi3.checkpoint import CheckpointError, build_state_dict, read_tensors

from kimi3_conversion.config_check import model_class, unquantized
from kimi3_conversion.tensor_io import open_safetensors

FORWARD_CHECK_SHAPE = (2, 24)  # random token ids the forward check runs on


def value_checks_for(text_config):
    """Per-tensor value checks: finite floats, E8M0 scales that are not 0xFF (NaN), a zero `A_log` padding.
    Returns fn(name, tensor, path) that raises an error naming the tensor and the file."""
    heads = text_config.kda_num_heads

    def check(name, t, path):
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                first = [int(i) for i in bad.nonzero()[0]]
                raise CheckpointError(f"{name} in {path}: {int(bad.sum())} non-finite values (first at {first}); "
                                      "corrupt data")
        if name.endswith(".weight_scale"):
            nan = t == 0xFF
            if bool(nan.any()):
                first = [int(i) for i in nan.nonzero()[0]]
                raise CheckpointError(f"{name} in {path}: E8M0 scale 0xFF (NaN) at {first} "
                                      f"({int(nan.sum())} such scales)")
        if name.endswith("self_attn.A_log") and t.dim() == 1 and t.numel() > heads:
            if bool((t[heads:] != 0).any()):
                raise CheckpointError(f"{name} in {path}: stored [{t.numel()}] for {heads} heads, but the padded "
                                      "tail holds non-zero values")

    return check


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def verify_shards(job, folder, progress):
    """Read every output tensor in `folder` back with safetensors and compare it bit for bit with what the source
    gives. Returns the number of tensors compared."""
    produce = job.producer.fresh()
    n = 0
    for fname, specs in job.shards:
        path = os.path.join(folder, fname)
        with open_safetensors(path) as f:
            if sorted(f.keys()) != sorted(t.name for t in specs):
                raise CheckpointError(f"{path}: holds other tensors than planned")
            for t in specs:
                if not _same_bytes(f.get_tensor(t.name), produce(t)):
                    raise CheckpointError(f"{t.name} in {path}: differs from the source after writing")
                n += 1
                progress.update(t.nbytes)
    return n


def load_model_from_files(config, files, fix_state_dict=None):
    """Our model (fp32, experts dequantised) from shard files and a config object: what `from_pretrained` does,
    without needing config.json or the index on disk. `fix_state_dict(sd) -> sd` may edit the weights first."""
    cfg = unquantized(config)
    cls = model_class(cfg)
    sd = build_state_dict(cls, cfg, read_tensors(files))
    if fix_state_dict is not None:
        sd = fix_state_dict(sd)
    return cls.from_pretrained(None, config=cfg, state_dict=sd, dtype=torch.float32).eval()


def _random_ids(config):
    text = config.get_text_config()
    ids = torch.randint(0, text.vocab_size, FORWARD_CHECK_SHAPE, generator=torch.Generator().manual_seed(0))
    media = getattr(config, "media_placeholder_token_id", None)
    if media is not None:  # a placeholder without an image is an error, not a token
        ids[ids == media] = (media + 1) % text.vocab_size
    return ids


def make_forward_check(config, source_files, n_params, fix_source=None, tol=1e-6):
    """fn(output files, max_gb) -> summary line: the logits of the source model (after `fix_source`) and of the
    output model on random tokens, equal to `tol` relative to the largest logit. Skipped when two fp32 copies
    (8 bytes per parameter) exceed `max_gb`."""

    def check(out_files, max_gb):
        need = n_params * 8 / 1e9
        if max_gb <= 0 or need > max_gb:
            return f"forward check skipped: two fp32 copies need {need:.1f} GB (> --forward-check-max-gb {max_gb:g})"
        ids = _random_ids(config)
        logits = []
        for files, fix in ((source_files, fix_source), (out_files, None)):
            model = load_model_from_files(config, files, fix)
            with torch.no_grad():
                logits.append(model(input_ids=ids, use_cache=False).logits.float())
            del model
        ref, got = logits
        diff = float((got - ref).abs().max())
        rel = diff / max(float(ref.abs().max()), 1e-30)
        if not rel <= tol:
            raise CheckpointError(f"forward check failed: output logits differ from the source's by {diff:.3g} "
                                  f"(relative {rel:.3g} > {tol:g})")
        return f"forward check: logits on random tokens {tuple(ids.shape)} equal (max abs diff {diff:.3g})"

    return check
