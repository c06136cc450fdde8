"""What `from_pretrained` refuses or converts in a checkpoint folder, with the field, tensor and file named: non-finite
weights, eps <= 0, F16 / F64 tensors, a misshapen (MXFP4) expert, config fields of the wrong type, and a config file
that leaves out the sizes (which would otherwise become the full-size K3 defaults)."""

import json
import logging
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from kimi3_testing import ROOT, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3Config, Kimi3ForCausalLM, Kimi3TextConfig, Kimi3VisionConfig
from transformers_kimi3.checkpoint import CheckpointError
from transformers_kimi3.mxfp4 import quantize_mxfp4
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

K3_CONFIG = os.path.join(ROOT, "assets", "kimi-k3-tiny", "config.json")
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny fp32 text model saved in 5 shards, so that an error must name the right one."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(folder, max_shard_size="300KB")
    return folder


def _copy(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst


def _shard_of(folder, key):
    return json.load(open(folder / "model.safetensors.index.json"))["weight_map"][key]


def _edit_tensors(folder, edit):
    """Apply edit(name -> tensor dict) to every shard and write them back."""
    for shard in sorted(folder.glob("*.safetensors")):
        sd = load_file(shard)
        edit(sd)
        save_file(sd, shard, metadata={"format": "pt"})


def _edit_config(folder, edit):
    path = folder / "config.json"
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))


# ----------------------------------------------------------------------------- item 4: values, eps, dtypes
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_non_finite_weight_is_refused_naming_tensor_and_shard(saved, tmp_path, bad):
    dst = _copy(saved, tmp_path)
    key = "model.layers.5.self_attn.q_proj.weight"
    shard = _shard_of(dst, key)
    sd = load_file(dst / shard)
    sd[key][3, 1] = bad
    save_file(sd, dst / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)} in .*{re.escape(shard)}: 1 non-finite values "
                                              r"\(NaN or Inf; first at \[3, 1\]\)"):
        Kimi3ForCausalLM.from_pretrained(dst)
    if bad != bad:  # the documented opt-out reads the folder as it is
        model = Kimi3ForCausalLM.from_pretrained(dst, check_finite=False)
        assert torch.isnan(model.model.layers[5].self_attn.q_proj.weight).any()


def test_float64_beyond_the_model_range_is_refused_after_conversion(saved, tmp_path):
    dst = _copy(saved, tmp_path)
    key = "model.layers.0.mlp.up_proj.weight"
    shard = _shard_of(dst, key)
    sd = load_file(dst / shard)
    sd[key] = sd[key].double()
    sd[key][0, 0] = 1e300
    save_file(sd, dst / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)} in .*{shard}: 1 non-finite.*after conversion "
                                              "from float64 to torch.float32"):
        Kimi3ForCausalLM.from_pretrained(dst)


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf")])
def test_eps_must_be_positive(eps):
    with pytest.raises(ValueError, match=r"`rms_norm_eps` = .* must be a positive number"):
        tiny_k3_text_config(rms_norm_eps=eps)
    with pytest.raises(ValueError, match=r"`vision_config\.projector_ln_eps` = .* must be a positive number"):
        Kimi3VisionConfig(projector_ln_eps=eps)


def test_negative_eps_in_the_file_or_an_edited_config_is_refused(saved, tmp_path):
    dst = _copy(saved, tmp_path)
    config = Kimi3TextConfig.from_pretrained(dst)
    config.rms_norm_eps = -1e-5  # edited after construction: checked again at load
    with pytest.raises(ValueError, match=r"`rms_norm_eps` = -1e-05"):
        Kimi3ForCausalLM.from_pretrained(dst, config=config)
    _edit_config(dst, lambda c: c.update(rms_norm_eps=-1e-5))
    with pytest.raises(ValueError, match=r"`rms_norm_eps` = -1e-05 must be a positive number"):
        Kimi3ForCausalLM.from_pretrained(dst)


def test_f16_and_f64_tensors_are_converted_with_one_log_line(saved, tmp_path, caplog):
    """Without a dtype in the config, F16 / F64 tensors would make the model fp16 / fp64: they become bf16, and fp32
    for the tensors the model keeps in fp32, with one log line that counts them."""
    dst = _copy(saved, tmp_path)
    _edit_config(dst, lambda c: c.pop("dtype"))
    _edit_tensors(dst, lambda sd: sd.update({k: v.double() if "layers.0." in k else v.half() for k, v in sd.items()}))
    n64 = sum(k.startswith("model.layers.0.") for k in json.load(open(dst / "model.safetensors.index.json"))
              ["weight_map"])
    with caplog.at_level(logging.WARNING, logger="transformers_kimi3"):
        model = Kimi3ForCausalLM.from_pretrained(dst)
    lines = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
    assert len(lines) == 1, lines
    assert re.search(r"converted \d+ float16 tensors to bfloat16, \d+ float16 tensors to float32, \d+ float64 tensors "
                     r"to bfloat16, \d+ float64 tensors to float32", lines[0]), lines[0]
    assert sum(int(n) for n in re.findall(r"(\d+) float64", lines[0])) == n64
    assert str(dst) in lines[0]
    attn = model.model.layers[0].self_attn
    assert model.lm_head.weight.dtype == model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert attn.A_log.dtype == torch.float32 and attn.q_conv1d.weight.dtype == torch.float32


# ----------------------------------------------------------------------------- item 5: misshapen experts
def _packed_checkpoint(saved, tmp_path):
    """The tiny model with its routed experts stored as MXFP4 (`weight_packed` / `weight_scale`)."""
    dst = _copy(saved, tmp_path)

    def pack(sd):
        for k in [k for k in sd if EXPERT_WEIGHT.search(k)]:
            base = k[: -len(".weight")]
            sd[base + ".weight_packed"], sd[base + ".weight_scale"] = quantize_mxfp4(sd.pop(k), name=base)
    _edit_tensors(dst, pack)
    _edit_config(dst, lambda c: c.update(quantization_config={"quant_method": "compressed-tensors",
                                                              "format": "mxfp4-pack-quantized"}))
    index = json.load(open(dst / "model.safetensors.index.json"))
    index["weight_map"] = {n: shard.name for shard in sorted(dst.glob("*.safetensors")) for n in load_file(shard)}
    json.dump(index, open(dst / "model.safetensors.index.json", "w"))
    return dst


@pytest.mark.parametrize("kind", ["weight_packed", "weight"])
def test_misshapen_expert_is_named_with_shapes_and_file(saved, tmp_path, kind):
    """Expert 3 of layer 1 stored for a [32, 64] down projection where the config implies [32, 32]: a named error,
    not torch.stack's "stack expects each tensor to be equal size"."""
    dst = _packed_checkpoint(saved, tmp_path) if kind == "weight_packed" else _copy(saved, tmp_path)
    key = f"model.layers.1.block_sparse_moe.experts.3.w2.{kind}"
    shard = _shard_of(dst, key)
    sd = load_file(dst / shard)
    if kind == "weight_packed":
        sd[key], sd[key.replace("packed", "scale")] = quantize_mxfp4(torch.randn(32, 64))
        want, got = "[32, 16] for an MXFP4 [32, 32] expert matrix", "[32, 32]"
    else:
        sd[key] = torch.randn(32, 64)
        want, got = "[32, 32] for a [32, 32] expert matrix", "[32, 64]"
    save_file(sd, dst / shard, metadata={"format": "pt"})
    message = rf"{re.escape(key)} in .*{re.escape(shard)}: shape {re.escape(got)} but the config implies "
    with pytest.raises(CheckpointError, match=message + rf"{re.escape(want)} \(config: moe_intermediate_size=32"):
        Kimi3ForCausalLM.from_pretrained(dst)


def test_misshapen_packed_experts_in_load_state_dict_are_named():
    experts = PackedMXFP4Experts(4, 32, 32)
    sd = experts.state_dict()
    u8 = dict(dtype=torch.uint8)
    sd["w1_packed"], sd["w1_scale"] = torch.zeros(4, 32, 32, **u8), torch.zeros(4, 32, 2, **u8)  # a [32, 64] matrix
    with pytest.raises(ValueError, match=r"w1_packed: shape \[4, 32, 32\] but these experts hold \[4, 32, 16\]"):
        experts.load_state_dict(sd)


# ----------------------------------------------------------------------------- item 6: config fields
@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(num_hidden_layers=None), r"`num_hidden_layers` = None must be an integer"),
    (lambda c: c.update(num_hidden_layers="7"), r"`num_hidden_layers` = '7' must be an integer"),
    (lambda c: c.update(num_experts=8.5), r"`num_experts` = 8.5 must be an integer or null"),
    (lambda c: c.update(rms_norm_eps="1e-5"), r"`rms_norm_eps` = '1e-5' must be a number"),
    (lambda c: c["linear_attn_config"].update(gate_lower_bound="-5"),
     r"`linear_attn_config\.gate_lower_bound` = '-5' must be a number or null"),
    (lambda c: c.pop("hidden_size"), r"`hidden_size` is missing from the config file.*full-size K3 value 7168"),
    (lambda c: c.pop("num_hidden_layers"), r"`num_hidden_layers` is missing from the config file"),
    (lambda c: c.pop("vocab_size"), r"`vocab_size` is missing from the config file"),
])
def test_bad_text_config_file_names_the_field(saved, tmp_path, edit, message):
    dst = tmp_path / "cfg"
    dst.mkdir()
    shutil.copy(saved / "config.json", dst / "config.json")
    _edit_config(dst, edit)
    with pytest.raises(ValueError, match=message):
        Kimi3TextConfig.from_pretrained(dst)


def test_model_load_names_the_missing_size_not_the_shapes(saved, tmp_path):
    dst = _copy(saved, tmp_path)
    _edit_config(dst, lambda c: c.pop("hidden_size"))
    with pytest.raises(ValueError, match=r"`hidden_size` is missing from the config file"):
        Kimi3ForCausalLM.from_pretrained(dst)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.pop("text_config"), r"`text_config` is missing from the kimi_k3 config file"),
    (lambda c: c["text_config"].pop("hidden_size"), r"`text_config\.hidden_size` is missing from the config file"),
    (lambda c: c["text_config"].pop("vocab_size"), r"`text_config\.vocab_size` is missing"),
    (lambda c: c.pop("vision_config"), r"`vision_config` is missing from the kimi_k3 config file"),
    (lambda c: c["text_config"].update(num_hidden_layers=None), r"`num_hidden_layers` = None must be an integer"),
])
def test_bad_k3_config_file_names_the_field(tmp_path, edit, message):
    shutil.copy(K3_CONFIG, tmp_path / "config.json")
    _edit_config(tmp_path, edit)
    for load in (Kimi3Config.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(ValueError, match=message):
            load(tmp_path)
    if "text_config" in message:
        with pytest.raises(ValueError, match=r"`text_config[`.]"):
            Kimi3TextConfig.from_pretrained(tmp_path)


def test_python_defaults_and_round_trips_still_work(tmp_path):
    """Built in Python with no arguments the configs are K3's (the Transformers convention); dicts and folders that
    our configs write read back unchanged."""
    assert Kimi3TextConfig().hidden_size == 7168 and Kimi3Config().text_config.num_hidden_layers == 93
    text = tiny_k3_text_config()
    assert Kimi3TextConfig.from_dict(text.to_dict()).to_dict() == text.to_dict()
    k3 = Kimi3Config.from_pretrained(os.path.dirname(K3_CONFIG))
    assert Kimi3Config.from_dict(k3.to_dict()).to_dict() == k3.to_dict()
    k3.save_pretrained(tmp_path)
    def fields(config):  # _name_or_path records where it was read from
        return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    assert fields(AutoConfig.from_pretrained(tmp_path)) == fields(k3)
