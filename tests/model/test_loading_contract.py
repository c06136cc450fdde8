"""What loads into what, and what `from_pretrained` reports: base model and heads load each other's folders
both ways (as `base_model_prefix` does in Transformers), `output_loading_info=True` returns `(model, loading_info)` with
Transformers' keys, weights Transformers initialises on purpose (a head missing from a base model's folder, a tied
head, `ignore_mismatched_sizes`) are initialised and reported while any other missing tensor stays an error, and the
Auto classes never build Transformers' native Kimi Linear from a folder with K3-only fields."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from kimi3_testing import BLOCK_PACKAGE, ROOT, run_python, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3Config, Kimi3ForCausalLM, Kimi3ForConditionalGeneration, Kimi3Model, Kimi3TextConfig
from transformers_kimi3.checkpoint import CheckpointError

K3_TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")
IDS = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
NOTHING = {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}


def _info(missing=(), unexpected=(), mismatched=()):
    return {"missing_keys": set(missing), "unexpected_keys": set(unexpected), "mismatched_keys": set(mismatched),
            "error_msgs": []}


def _keys(folder):
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _same(got, want):
    """Loaded weights are mapped from the file, so their alignment depends on the file's layout, and the fp32 CPU
    kernels round differently with it (1e-8 here): equal weights give outputs equal to 1e-6, not bit for bit."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return True


def _same_weights(model, ref):
    """Every tensor of `ref` is in `model`, bit for bit."""
    got = model.state_dict()
    for name, t in ref.state_dict().items():
        assert torch.equal(got[name], t), name
    return True


def _hidden(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).last_hidden_state


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def lm():
    return tiny_model()


@pytest.fixture(scope="module")
def folders(lm, tmp_path_factory):
    """The tiny K3 text model saved by the head class (`lm`) and by its base model (`base`)."""
    root = tmp_path_factory.mktemp("loading")
    lm.save_pretrained(root / "lm")
    lm.model.save_pretrained(root / "base")
    return root


# ----------------------------------------------------------------------------- item 1: base model <-> heads
def test_base_model_round_trip(lm, folders):
    base = folders / "base"
    body = {k for k in _keys(folders / "lm") if k != "lm_head.weight"}
    assert _keys(base) == body  # the official text layout, `model.*`, as the head's body
    cfg = json.load(open(base / "config.json"))
    assert cfg["architectures"] == ["Kimi3Model"]
    reloaded, info = Kimi3Model.from_pretrained(base, output_loading_info=True)
    assert info == NOTHING
    assert _same_weights(reloaded, lm.model) and _same(_hidden(reloaded), _hidden(lm.model))
    assert all(p.is_contiguous() for p in reloaded.parameters())
    half = Kimi3Model.from_pretrained(base, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in half.named_parameters()}
    assert dtypes["embed_tokens.weight"] == torch.bfloat16 and dtypes["layers.0.self_attn.A_log"] == torch.float32
    assert torch.equal(half.embed_tokens.weight, lm.model.embed_tokens.weight.to(torch.bfloat16))
    # the second save of a loaded model writes the same tensors again
    reloaded.save_pretrained(folders / "base2")
    assert load_file(folders / "base2" / "model.safetensors").keys() == load_file(base / "model.safetensors").keys()
    for name, t in load_file(folders / "base2" / "model.safetensors").items():
        assert torch.equal(t, load_file(base / "model.safetensors")[name]), name


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_base_model_attention_implementations_load(lm, folders, attn):
    model = Kimi3Model.from_pretrained(folders / "base", attn_implementation=attn)
    assert model.config._attn_implementation == attn
    torch.testing.assert_close(_hidden(model), _hidden(lm.model), rtol=1e-5, atol=1e-5)


def test_head_folder_into_base_model(lm, folders):
    base, info = Kimi3Model.from_pretrained(folders / "lm", output_loading_info=True)
    assert info == _info(unexpected=["lm_head.weight"])
    assert _same_weights(base, lm.model) and _same(_hidden(base), _hidden(lm.model))


def test_base_folder_into_head_initialises_the_head(lm, folders):
    torch.manual_seed(0)
    model, info = Kimi3ForCausalLM.from_pretrained(folders / "base", output_loading_info=True)
    assert info == _info(missing=["lm_head.weight"])
    assert _same_weights(model.model, lm.model) and _same(_hidden(model.model), _hidden(lm.model))
    head = model.lm_head.weight.detach()
    assert bool(torch.isfinite(head).all()) and 0.015 < float(head.std()) < 0.025  # normal(0, initializer_range)
    assert float(head.mean().abs()) < 0.003


def test_base_model_folder_without_prefix_loads_both_ways(lm, folders, tmp_path):
    """A Transformers base model (the native KimiLinearModel, say) writes its own names, without `model.`."""
    dst = tmp_path / "bare"
    shutil.copytree(folders / "base", dst)
    sd = load_file(dst / "model.safetensors")
    save_file({k[len("model."):]: v for k, v in sd.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    assert not any(k.startswith("model.") for k in _keys(dst))
    base, info = Kimi3Model.from_pretrained(dst, output_loading_info=True)
    assert info == NOTHING and _same_weights(base, lm.model) and _same(_hidden(base), _hidden(lm.model))
    model, info = Kimi3ForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert info == _info(missing=["lm_head.weight"]) and _same_weights(model.model, lm.model)


# ----------------------------------------------------------------------------- item 2: output_loading_info
def test_output_loading_info_returns_model_and_info(lm, folders):
    out = Kimi3ForCausalLM.from_pretrained(folders / "lm", output_loading_info=True)
    assert isinstance(out, tuple) and len(out) == 2
    model, info = out
    assert info == NOTHING
    assert _same_weights(model, lm) and _same(_logits(model), _logits(lm))
    assert model.name_or_path == str(folders / "lm")
    assert isinstance(Kimi3ForCausalLM.from_pretrained(folders / "lm"), Kimi3ForCausalLM)


# ----------------------------------------------------------------------------- K3 folders and text classes
@pytest.fixture(scope="module")
def k3():
    return Kimi3ForConditionalGeneration.from_pretrained(K3_TINY, dtype=torch.float32).eval()


def test_k3_folder_into_text_classes(k3):
    vision = {k for k in _keys(K3_TINY) if k.startswith(("vision_tower.", "mm_projector."))}
    assert len(vision) == 18
    ids = torch.randint(3, 448, (1, 9), generator=torch.Generator().manual_seed(1))
    lm, info = Kimi3ForCausalLM.from_pretrained(K3_TINY, dtype=torch.float32, output_loading_info=True)
    assert info == _info(unexpected=vision)
    assert _same_weights(lm, k3.language_model) and _same(_logits(lm, ids), _logits(k3, ids))
    base, info = Kimi3Model.from_pretrained(K3_TINY, dtype=torch.float32, output_loading_info=True)
    assert info == _info(unexpected=vision | {"language_model.lm_head.weight"})
    assert _same_weights(base, k3.language_model.model)
    assert _same(_hidden(base, ids), _hidden(k3.language_model.model, ids))


def test_k3_round_trip_reports_nothing(k3, tmp_path):
    k3.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["model_type"] == "kimi_linear"
    model, info = Kimi3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32,
                                                                output_loading_info=True)
    assert info == NOTHING and _same_weights(model, k3)
    ids = torch.randint(3, 448, (1, 9), generator=torch.Generator().manual_seed(2))
    assert _same(_logits(model, ids), _logits(k3, ids))


@pytest.mark.parametrize("folder", ["lm", "base"])
def test_text_folder_into_k3_class_is_refused(folders, folder):
    with pytest.raises(CheckpointError, match=rf"{folder}/config\.json describes a text-only model \(model_type "
                                              r"'kimi_k3_text'.*load it with Kimi3ForCausalLM or Kimi3Model"):
        Kimi3ForConditionalGeneration.from_pretrained(folders / folder)


# ----------------------------------------------------------------------------- item 3: what may be missing
def _drop(src, dst, names):
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    for n in names:
        del sd[n]
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_head_missing_from_a_head_folder_is_an_error(folders, tmp_path):
    dst = _drop(folders / "lm", tmp_path / "nohead", ["lm_head.weight"])
    with pytest.raises(CheckpointError, match=r"1 missing tensors \['lm_head\.weight'\].*base model's folder.*"
                                              r"names \['Kimi3ForCausalLM'\]"):
        Kimi3ForCausalLM.from_pretrained(dst)


@pytest.mark.parametrize("cls", [Kimi3Model, Kimi3ForCausalLM])
def test_body_tensor_missing_from_a_base_folder_is_an_error(folders, tmp_path, cls):
    dst = _drop(folders / "base", tmp_path / "nobody", ["model.layers.2.self_attn.q_proj.weight"])
    name = "layers.2.self_attn.q_proj.weight" if cls is Kimi3Model else "model.layers.2.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match=rf"does not match {cls.__name__}: 1 missing tensors \['{name}'\]; "
                                              r"0 unexpected"):
        cls.from_pretrained(dst)


def test_unknown_tensor_is_still_an_error(folders, tmp_path):
    dst = tmp_path / "extra"
    shutil.copytree(folders / "base", dst)
    sd = load_file(dst / "model.safetensors")
    sd["model.layers.1.surprise"] = torch.zeros(2)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    for cls in (Kimi3Model, Kimi3ForCausalLM):
        with pytest.raises(CheckpointError, match=r"0 missing tensors \[\]; 1 unexpected tensors \['(model\.)?"
                                                  r"layers\.1\.surprise'\]"):
            cls.from_pretrained(dst)


def test_tied_embeddings(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in _keys(tmp_path / "tied")  # saved once, as Transformers does
    reloaded, info = Kimi3ForCausalLM.from_pretrained(tmp_path / "tied", output_loading_info=True)
    assert info == NOTHING and reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert _same_weights(reloaded, model) and _same(_logits(reloaded), _logits(model))
    base, info = Kimi3Model.from_pretrained(tmp_path / "tied", output_loading_info=True)
    assert info == NOTHING and _same(_hidden(base), _hidden(model.model))
    model.model.save_pretrained(tmp_path / "tied-base")  # a tied head needs no head in the folder
    head, info = Kimi3ForCausalLM.from_pretrained(tmp_path / "tied-base", output_loading_info=True)
    assert info == NOTHING and head.lm_head.weight is head.model.embed_tokens.weight
    assert _same_weights(head, model) and _same(_logits(head), _logits(model))


def test_tied_embeddings_in_k3(tmp_path):
    cfg = Kimi3Config.from_pretrained(K3_TINY)
    cfg.text_config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = Kimi3ForConditionalGeneration(cfg).eval()
    assert model.language_model.lm_head.weight is model.language_model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert not any("lm_head" in k for k in _keys(tmp_path))
    reloaded, info = Kimi3ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert info == NOTHING and _same_weights(reloaded, model)
    assert reloaded.language_model.lm_head.weight is reloaded.language_model.model.embed_tokens.weight
    ids = torch.randint(3, 448, (1, 7), generator=torch.Generator().manual_seed(3))
    assert _same(_logits(reloaded, ids), _logits(model, ids))


def test_ignore_mismatched_sizes_initialises_and_reports(lm, folders):
    cfg = Kimi3TextConfig.from_pretrained(folders / "lm")
    cfg.vocab_size = 128
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight: checkpoint shape \(96, 64\) != "
                                              r"\(128, 64\).*ignore_mismatched_sizes=True"):
        Kimi3ForCausalLM.from_pretrained(folders / "lm", config=cfg)
    model, info = Kimi3ForCausalLM.from_pretrained(folders / "lm", config=cfg, ignore_mismatched_sizes=True,
                                                   output_loading_info=True)
    grown, old = torch.Size([128, 64]), torch.Size([96, 64])
    assert info == _info(mismatched=[("model.embed_tokens.weight", old, grown), ("lm_head.weight", old, grown)])
    assert model.lm_head.weight.shape == grown
    assert torch.equal(model.model.layers[0].self_attn.A_log, lm.model.layers[0].self_attn.A_log)


# ----------------------------------------------------------------------------- item 8: the Auto classes
def test_text_folder_config_names_k3_only_fields(folders):
    for folder in ("lm", "base"):
        cfg = json.load(open(folders / folder / "config.json"))
        assert cfg["model_type"] == "kimi_k3_text"
        assert cfg["auto_map"] == {"AutoConfig": "configuration_kimi3.Kimi3TextConfig",
                                   "AutoModel": "modeling_kimi3.Kimi3Model",
                                   "AutoModelForCausalLM": "modeling_kimi3.Kimi3ForCausalLM"}
        assert os.path.exists(folders / folder / "modeling_kimi3.py")
    assert tiny_k3_text_config().k3_only_fields() == [
        "attn_res_block_size", "hidden_act", "routed_expert_hidden_size", "mla_use_output_gate",
        "linear_attn_config.gate_lower_bound", "linear_attn_config.use_full_rank_gate"]


def test_kimi_linear_folder_keeps_the_official_type(tmp_path):
    """Without K3-only fields the folder is a Kimi Linear checkpoint: "kimi_linear", which Transformers' native class
    and the serving engines build."""
    cfg = tiny_k3_text_config(hidden_act="silu", activation_situ_beta=None, activation_situ_linear_beta=None,
                              mla_use_output_gate=False, attn_res_block_size=None, routed_expert_hidden_size=None,
                              latent_moe_use_norm=False,
                              linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4,
                                                      kda_layers=[1, 2, 3, 5, 6], full_attn_layers=[4, 7]))
    assert cfg.k3_only_fields() == []
    torch.manual_seed(0)
    model = Kimi3ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    assert json.load(open(tmp_path / "config.json"))["model_type"] == "kimi_linear"
    reloaded, info = Kimi3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info == NOTHING and _same_weights(reloaded, model) and _same(_logits(reloaded), _logits(model))


def test_auto_classes_take_our_classes(lm, folders):
    for folder in ("lm", "base"):
        head = AutoModelForCausalLM.from_pretrained(folders / folder)
        base = AutoModel.from_pretrained(folders / folder)
        assert type(head) is Kimi3ForCausalLM and type(base) is Kimi3Model
        assert _same_weights(base, lm.model) and _same(_hidden(base), _hidden(lm.model))
        if folder == "lm":
            assert _same_weights(head, lm) and _same(_logits(head), _logits(lm))


def test_auto_classes_without_the_package(lm, folders, tmp_path):
    """Without transformers_kimi3: no KeyError from the native class, but Transformers' request for
    trust_remote_code=True; with it, the folder's own code loads base model and head from either folder."""
    torch.save({"ids": IDS, "hidden": _hidden(lm.model), "logits": _logits(lm)}, tmp_path / "io.pt")
    code = BLOCK_PACKAGE + f"""
import os, sys, torch, transformers
sys.stdin = open(os.devnull)  # Transformers asks on a terminal before refusing: answer at once
io = torch.load({str(tmp_path / 'io.pt')!r})
for folder in ("lm", "base"):
    path = {str(folders)!r} + "/" + folder
    for auto in ("AutoModel", "AutoModelForCausalLM"):
        try:
            getattr(transformers, auto).from_pretrained(path)
            raise SystemExit(f"{{auto}} loaded {{folder}} without trust_remote_code")
        except ValueError as e:
            assert "trust_remote_code=True" in str(e), str(e)
        m = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).eval()
        assert 'transformers_kimi3' not in type(m).__module__, type(m).__module__
        with torch.no_grad():
            out = m(input_ids=io['ids'], use_cache=False)
        if auto == "AutoModel":
            assert type(m).__name__ == "Kimi3Model"
            err = float((out.last_hidden_state - io['hidden']).abs().max() / io['hidden'].abs().max())
            assert err < 1e-6, err
        else:
            assert type(m).__name__ == "Kimi3ForCausalLM"
            err = float((out.logits - io['logits']).abs().max() / io['logits'].abs().max())
            assert folder == "base" or err < 1e-6, err
        print("OK", folder, auto)
"""
    proc = run_python(code, env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("OK ") == 4


@pytest.mark.parametrize("auto", ["AutoModelForCausalLM", "AutoModel", "AutoModelForImageTextToText"])
def test_auto_classes_take_the_settings_from_pretrained_documents(auto):
    """README's settings (`from_pretrained(path, kda_backend=...)`) through every Auto class on a K3 folder, whose
    config nests them in text_config; a value that is no setting is refused with the field named."""
    import transformers

    cls = getattr(transformers, auto)
    model = cls.from_pretrained(K3_TINY, kda_backend="torch", fp32_logits=True, moe_activation_format="mxfp8")
    text = model.config.get_text_config()
    assert (text.kda_backend, text.fp32_logits, text.moe_activation_format) == ("torch", True, "mxfp8")
    with pytest.raises(ValueError, match="kda_backend"):
        cls.from_pretrained(K3_TINY, kda_backend="bogus")
