"""The checks at the model's entry: each bad input named (which tensor, what shape or value, what to pass instead)
before a layer or kernel reads it. Host-side where they can be; the value checks that read the device say so."""

import torch


def check_input_types(**inputs):
    """Each given input a tensor (token ids integers, pixels floats), named, before anything reads its shape."""
    for name, x in inputs.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            hint = ""
            if isinstance(x, (list, tuple)):
                hint = ": wrap it, e.g. torch.tensor(...)"
            elif isinstance(x, str) and name == "input_ids":
                hint = ': tokenize the text first, e.g. tokenizer(text, return_tensors="pt")'
            elif isinstance(x, str):
                hint = ': let the processor make it, e.g. processor(text=..., images=..., return_tensors="pt")'
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}{hint}")
        if name == "input_ids" and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
            raise TypeError(f"input_ids must hold integer token ids, got {x.dtype}")


def check_input_shapes(input_ids, inputs_embeds, attention_mask):
    """Shape errors at the model's entry, named, instead of deep inside a layer (host-side: no GPU sync)."""
    check_input_types(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask)
    name, x, dims = (("input_ids", input_ids, "[batch, seq_len]") if input_ids is not None
                     else ("inputs_embeds", inputs_embeds, "[batch, seq_len, hidden]"))
    if x.dim() != len(dims.split(",")):
        raise ValueError(f"{name} must be {dims}, got shape {list(x.shape)}"
                         + (" (add a batch dimension: input_ids[None])" if name == "input_ids" and x.dim() == 1 else ""))
    if x.shape[1] == 0:
        raise ValueError(f"{name} has no tokens (shape {list(x.shape)}): pass at least one token per row")
    if attention_mask is not None and attention_mask.shape[0] != x.shape[0]:
        raise ValueError(f"attention_mask has batch size {attention_mask.shape[0]}, {name} has {x.shape[0]}")


def check_media_inputs(input_ids, pixel_values, placeholder):
    """A prompt's media placeholders need pixels, and pixels must be finite (a NaN pixel reaches every logit)."""
    if pixel_values is None:
        if input_ids is not None and bool((input_ids == placeholder).any()):
            n = int((input_ids == placeholder).sum())
            raise ValueError(f"input_ids hold {n} media placeholder(s) (id {placeholder}) but no pixel_values were "
                             "given: pass the image's pixel_values and grid_thws (the processor makes both), or "
                             "remove the placeholder")
        return
    if not pixel_values.is_floating_point():
        raise ValueError(f"pixel_values must be a float tensor, got {pixel_values.dtype}")
    if not bool(torch.isfinite(pixel_values).all()):
        bad = int((~torch.isfinite(pixel_values)).sum())
        raise ValueError(f"pixel_values hold {bad} NaN or infinite value(s) of {pixel_values.numel()}")


def check_token_ids(input_ids, embedding):
    """The ids must index rows of the current input embedding: its row count, not a size fixed at init, so ids
    added by `resize_token_embeddings` (new special tokens) are accepted and ids cut by it are not."""
    vocab_size = embedding_rows(embedding)
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)]
        raise ValueError(f"input_ids hold {bad.unique()[:8].tolist()} outside the vocabulary 0..{vocab_size - 1} "
                         f"(the input embedding has {vocab_size} rows)")


def embedding_rows(embedding):
    """The vocabulary size of an input embedding: `num_embeddings` (kept by wrappers that delegate attributes, and
    by ZeRO-3 / FSDP, whose local weight is a shard), else the weight's row count."""
    rows = getattr(embedding, "num_embeddings", None)
    return rows if rows is not None else embedding.weight.shape[0]
