"""save_pretrained writes self-contained remote code: the folder loads with trust_remote_code=True in a Python
where transformers_kimi3 (and kimi3_kernels) cannot be imported."""

import json
import os

import torch

from kimi3_testing import BLOCK_PACKAGE, ORACLE_A, needs_oracle, run_python, tiny_model



def _roundtrip(folder, auto, ids, expected, tmp_path):
    torch.save({"ids": ids, "expected": expected}, tmp_path / "io.pt")
    code = BLOCK_PACKAGE + f"""
import torch, transformers
m = transformers.{auto}.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32).eval()
assert 'transformers_kimi3' not in type(m).__module__, type(m).__module__
io = torch.load({str(tmp_path / 'io.pt')!r})
with torch.no_grad():
    got = m(input_ids=io['ids'], use_cache=False).logits
err = float((got - io['expected']).abs().max() / io['expected'].abs().max())
gen = m.generate(io['ids'][:, :6], max_new_tokens=3, do_sample=False, pad_token_id=0)
# listed with Transformers' causal LMs, as with the package imported: Trainer's label smoothing shifts the labels
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
assert type(m).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(), type(m).__name__
print('REL', err, type(m).__name__, gen.shape[1])
"""
    proc = run_python(code, env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REL")][-1].split()
    return float(line[1]), line[2], int(line[3])


def test_text_model_remote_code_roundtrip(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m")
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi3.Kimi3ForCausalLM"
    assert os.path.exists(tmp_path / "m" / "modeling_kimi3.py")
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    rel, cls, n = _roundtrip(tmp_path / "m", "AutoModelForCausalLM", ids, expected, tmp_path)
    assert rel < 1e-5 and cls == "Kimi3ForCausalLM" and n == 9  # fp32 rounding across processes (threads)


@needs_oracle
def test_official_folder_remote_code_roundtrip(tmp_path):
    from transformers_kimi3 import Kimi3ForConditionalGeneration

    model = Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "k3")
    ids = torch.randint(3, 448, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    rel, cls, _ = _roundtrip(tmp_path / "k3", "AutoModelForImageTextToText", ids, expected, tmp_path)
    assert rel < 1e-5 and cls == "Kimi3ForConditionalGeneration"


@needs_oracle
def test_saved_official_folder_carries_only_our_auto_map(tmp_path):
    from transformers_kimi3 import Kimi3ForConditionalGeneration

    Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A).save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    ours = "modeling_kimi3.Kimi3ForConditionalGeneration"
    assert cfg["auto_map"] == {"AutoConfig": "configuration_kimi3.Kimi3Config", "AutoModel": ours,
                               "AutoModelForCausalLM": ours, "AutoModelForImageTextToText": ours}
    assert "auto_map" not in cfg["text_config"]
    for module in ("configuration_kimi3.py", "modeling_kimi3.py"):
        assert os.path.exists(tmp_path / module)


@needs_oracle
def test_auto_map_names_the_kimi_class_under_a_runtime_wrapper(tmp_path):
    """FSDP2's `fully_shard` turns the model into an instance of `FSDP<class>`, a subclass defined in torch, and
    Trainer / Accelerate call `save_pretrained` on it: the folder must still name our class."""
    from transformers_kimi3 import Kimi3ForConditionalGeneration

    model = Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A)
    model.__class__ = type("FSDPKimi3ForConditionalGeneration", (Kimi3ForConditionalGeneration,),
                           {"__module__": "torch.distributed.fsdp._fully_shard._fully_shard"})
    model.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    assert set(cfg["auto_map"].values()) == {"configuration_kimi3.Kimi3Config",
                                             "modeling_kimi3.Kimi3ForConditionalGeneration"}
