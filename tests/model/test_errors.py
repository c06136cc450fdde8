"""Bad configs, bad checkpoints and bad inputs: each gives a clear error that names what is wrong."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi3_testing import ORACLE_A, ROOT, needs_oracle, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3Config, Kimi3ForCausalLM, Kimi3TextConfig
from transformers_kimi3.checkpoint import CheckpointError

LAC = dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, kda_layers=[1, 2], full_attn_layers=[3])


@pytest.mark.parametrize("overrides,field", [
    (dict(linear_attn_config=dict(LAC, kda_layers=[1])), "cover every layer"),
    (dict(linear_attn_config=dict(LAC, kda_layers=[1, 2, 3])), "both claim"),
    (dict(linear_attn_config=dict(LAC, kda_layers=[0, 1, 2])), "1-indexed"),
    (dict(num_experts=4, num_experts_per_token=5), "num_experts_per_token"),
    (dict(attn_res_block_size=0), "attn_res_block_size"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(linear_attn_config=dict(LAC, head_dim=0)), "linear_attn_config.head_dim"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(num_expert_group=3, num_experts=8), "num_expert_group"),
    (dict(linear_attn_config=dict(LAC, gate_lower_bound=1.0)), "gate_lower_bound"),
])
def test_bad_text_config(overrides, field):
    kw = dict(num_hidden_layers=3, linear_attn_config=LAC, num_experts=8, num_experts_per_token=2)
    kw.update(overrides)
    with pytest.raises(ValueError, match=field):
        Kimi3TextConfig(**kw)


def test_bad_vision_and_top_level_config():
    with pytest.raises(ValueError, match="qkv_hidden_size"):
        Kimi3Config(vision_config=dict(qkv_hidden_size=50, vt_num_attention_heads=3))
    with pytest.raises(ValueError, match="media_placeholder_token_id"):
        Kimi3Config(text_config=dict(vocab_size=100, linear_attn_config=LAC, num_hidden_layers=3),
                    media_placeholder_token_id=500)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(folder)
    return folder


def _copy(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst, load_file(dst / "model.safetensors")


def test_missing_and_unexpected_tensors_are_listed(saved, tmp_path):
    dst, sd = _copy(saved, tmp_path)
    del sd["model.layers.2.self_attn.q_proj.weight"]
    sd["model.layers.2.self_attn.surprise"] = torch.zeros(3)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*surprise|missing.*q_proj"):
        Kimi3ForCausalLM.from_pretrained(dst)


def test_missing_expert_is_named(saved, tmp_path):
    dst, sd = _copy(saved, tmp_path)
    del sd["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.\*\.w2.*missing \['5\.weight'\]"):
        Kimi3ForCausalLM.from_pretrained(dst)


def test_wrong_shape_is_named(saved, tmp_path):
    dst, sd = _copy(saved, tmp_path)
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(5, 5)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.o_proj\.weight.*\(5, 5\)"):
        Kimi3ForCausalLM.from_pretrained(dst)


def test_truncated_and_corrupt_files(saved, tmp_path):
    dst, _ = _copy(saved, tmp_path)
    path = dst / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated or corrupt"):
        Kimi3ForCausalLM.from_pretrained(dst)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        Kimi3ForCausalLM.from_pretrained(dst)


def test_pickles_are_never_loaded(saved, tmp_path):
    dst, sd = _copy(saved, tmp_path)
    os.remove(dst / "model.safetensors")
    torch.save(sd, dst / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickled weights are never loaded"):
        Kimi3ForCausalLM.from_pretrained(dst)


@needs_oracle
def test_a_log_with_nonzero_padded_tail_is_refused(tmp_path):
    dst = tmp_path / "k3"
    shutil.copytree(ORACLE_A, dst)
    sd = load_file(dst / "model.safetensors")
    key = "language_model.model.layers.0.self_attn.A_log"
    sd[key] = sd[key].clone()
    sd[key][-1] = 0.5
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.A_log.*non-zero"):
        Kimi3ForCausalLM.from_pretrained(dst)


@needs_oracle
def test_nan_mxfp4_scale_is_refused(tmp_path):
    dst = tmp_path / "k3"
    shutil.copytree(ORACLE_A, dst)
    sd = load_file(dst / "model.safetensors")
    key = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight_scale"
    sd[key] = sd[key].clone()
    sd[key][0, 0] = 0xFF
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.w1: weight_scale holds 0xFF"):
        Kimi3ForCausalLM.from_pretrained(dst)


@needs_oracle
def test_source_folder_is_untouched_by_loading_and_saving(tmp_path):
    before = {f: os.path.getmtime(os.path.join(ORACLE_A, f)) for f in os.listdir(ORACLE_A)}
    Kimi3ForCausalLM.from_pretrained(ORACLE_A).save_pretrained(tmp_path / "out")
    assert before == {f: os.path.getmtime(os.path.join(ORACLE_A, f)) for f in os.listdir(ORACLE_A)}


def test_out_of_range_token_ids():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"outside the vocabulary 0\.\.95"):
        model(input_ids=torch.tensor([[1, 96]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(input_ids=torch.tensor([[-1, 3]]))


@needs_oracle
def test_placeholder_count_mismatch_names_both_numbers():
    from transformers_kimi3 import Kimi3ForConditionalGeneration
    from safetensors.torch import load_file as lf

    model = Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A, dtype=torch.float32)
    o = lf(os.path.join(ORACLE_A, "inputs_and_logits.safetensors"))
    ids = torch.cat([o["mm_input_ids"], torch.tensor([[469]])], 1)  # two placeholders, one image
    with pytest.raises(ValueError, match="2 media placeholders.*but 1 images"):
        model(input_ids=ids, pixel_values=o["mm_pixel_values"], grid_thws=o["mm_grid_thws"])


@needs_oracle
def test_config_json_keeps_official_keys(tmp_path):
    cfg = Kimi3Config.from_pretrained(ORACLE_A)
    cfg.save_pretrained(tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    official = json.load(open(os.path.join(ORACLE_A, "config.json")))
    assert saved["model_type"] == "kimi_k3" and saved["text_config"]["model_type"] == "kimi_linear"
    for key in ("linear_attn_config", "attn_res_block_size", "routed_expert_hidden_size", "quantization_config",
                "activation_situ_beta", "first_k_dense_replace", "num_experts_per_token"):
        assert saved["text_config"][key] == official["text_config"][key], key
    assert "layer_types" not in saved["text_config"]  # derived, never serialized
    # a text config on its own says "kimi_linear" only without K3-only fields (tests/model/test_loading_contract.py)
    assert tiny_k3_text_config().to_dict()["model_type"] == "kimi_k3_text"


def test_input_shapes_are_checked_at_the_entry():
    """Degenerate inputs get a ValueError that names the tensor, not an error from inside a layer: 1-D input_ids,
    empty rows, an attention_mask whose batch differs (padded or all ones), in forward and in generate."""
    from kimi3_testing import tiny_model

    model = tiny_model()
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    padded = torch.ones(3, 6, dtype=torch.long)
    padded[2, :2] = 0
    cases = [(dict(input_ids=ids[0]), "input_ids must be \\[batch, seq_len\\].*add a batch dimension"),
             (dict(input_ids=ids[:, :0]), "input_ids has no tokens"),
             (dict(input_ids=ids, attention_mask=padded), "attention_mask has batch size 3, input_ids has 2"),
             (dict(input_ids=ids, attention_mask=torch.ones(1, 6, dtype=torch.long)), "attention_mask has batch size 1"),
             (dict(inputs_embeds=torch.zeros(2, 64)), "inputs_embeds must be \\[batch, seq_len, hidden\\]")]
    with torch.no_grad():
        for kwargs, message in cases:
            with pytest.raises(ValueError, match=message):
                model(**kwargs)
        with pytest.raises(ValueError, match="attention_mask has batch size 3"):
            model.generate(input_ids=ids, attention_mask=padded, max_new_tokens=2, do_sample=False, pad_token_id=0)
        for impl in (None, "static"):  # a mask of another length is refused, not ignored
            with pytest.raises(ValueError, match=r"attention_mask has shape \[2, 5\], input_ids \[2, 6\]"):
                model.generate(input_ids=ids, attention_mask=torch.ones(2, 5, dtype=torch.long), max_new_tokens=2,
                               do_sample=False, pad_token_id=0, cache_implementation=impl)
        assert model(input_ids=ids, attention_mask=torch.ones(2, 6, dtype=torch.long)).logits.shape == (2, 6, 96)


@pytest.mark.parametrize("cls", ["Kimi3ForCausalLM", "Kimi3ForConditionalGeneration"])
def test_input_types_are_checked_at_the_entry(cls):
    """Text, a list or float ids instead of a token tensor, and a string instead of pixels: a TypeError that names
    the input and says what to pass, in forward and in generate (with 1-D ids too), not an AttributeError from
    inside."""
    import transformers_kimi3

    model = getattr(transformers_kimi3, cls).from_pretrained(os.path.join(ROOT, "assets", "kimi-k3-tiny"),
                                                             dtype=torch.float32)
    cases = [(dict(input_ids="Kimi K3 is"), TypeError, "input_ids must be a torch.Tensor, got str: tokenize"),
             (dict(input_ids=[[1, 2, 3]]), TypeError, "input_ids must be a torch.Tensor, got list: wrap it"),
             (dict(input_ids=torch.tensor([[1.0, 2.0]])), TypeError, "input_ids must hold integer token ids"),
             (dict(input_ids=torch.tensor([1, 2, 3])), ValueError, "add a batch dimension")]
    if cls == "Kimi3ForConditionalGeneration":
        cases.append((dict(input_ids=torch.tensor([[1, 2]]), pixel_values="img"), TypeError,
                      "pixel_values must be a torch.Tensor, got str: let the processor make it"))
    with torch.no_grad():
        for kwargs, error, message in cases:
            with pytest.raises(error, match=message):
                model(**kwargs)
        for ids, error, message in cases[:2] + cases[3:4]:
            with pytest.raises(error, match=message):
                model.generate(ids["input_ids"], max_new_tokens=2)


def test_media_inputs_are_checked_at_the_entry():
    """A media placeholder without pixels, and NaN / infinite pixels, are ValueErrors at the model's entry."""
    from transformers_kimi3 import Kimi3ForConditionalGeneration

    model = Kimi3ForConditionalGeneration.from_pretrained(os.path.join(ROOT, "assets", "kimi-k3-tiny")).eval()
    token = model.config.media_placeholder_token_id
    ids = torch.tensor([[5, 6, token, 7]])
    vision = model.config.vision_config
    grid = torch.tensor([[1, 2 * vision.merge_kernel_size[0], 2 * vision.merge_kernel_size[1]]])
    pixels = torch.rand(int(grid.prod()), 3, vision.patch_size, vision.patch_size)
    with torch.no_grad():
        with pytest.raises(ValueError, match=f"1 media placeholder.*id {token}.*no pixel_values"):
            model(input_ids=ids)
        with pytest.raises(ValueError, match="no pixel_values"):
            model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        for bad in (float("nan"), float("inf")):
            p = pixels.clone()
            p[0, 0, 0, 0] = bad
            with pytest.raises(ValueError, match="pixel_values hold 1 NaN or infinite value"):
                model(input_ids=ids, pixel_values=p, grid_thws=grid)
        assert torch.isfinite(model(input_ids=ids, pixel_values=pixels, grid_thws=grid).logits).all()
