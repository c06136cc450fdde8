"""conversion/ (package kimi3_conversion): convert_k3_to_hf, quantize_mxfp4, convert_kimi_linear.

Converted folders give the same logits as their sources; a converter killed with SIGKILL leaves nothing that
looks complete and resumes to a correct result; every bad input is refused with a message naming the tensor and
the file, before anything reaches the output path; sources are never modified."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kimi3_conversion import convert_k3_to_hf as K3
from kimi3_conversion import convert_kimi_linear as KL
from kimi3_conversion import quantize_mxfp4 as Q
from kimi3_conversion.config_check import load_config
from kimi3_conversion.extra_files import code_files
from kimi3_conversion.k3_job import K3_AUTO_MAP, TEXT_AUTO_MAP
from kimi3_conversion.resume import MANIFEST, load_manifest, partial_dir
from kimi3_conversion.tensor_io import INDEX
from kimi3_conversion.verify import load_model_from_files
from kimi3_testing import BLOCK_PACKAGE, ORACLE_A, ROOT, native_kimi_linear, rel_err

from transformers_kimi3 import Kimi3ForConditionalGeneration
from transformers_kimi3.mxfp4 import dequantize_mxfp4

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")
CARD = os.path.join(ROOT, "model_cards", "kimi-k3.md")
SCRIPTS = [os.path.join(ROOT, "conversion", f) for f in ("convert_k3_to_hf.py", "quantize_mxfp4.py",
                                                        "convert_kimi_linear.py")]
CONSOLE_SCRIPTS = ["kimi3-convert-k3", "kimi3-quantize-mxfp4", "kimi3-convert-kimi-linear"]  # same order
FAST = ["--quiet", "--forward-check-max-gb", "0"]  # the tests compare logits themselves (once per source)
IDS = torch.randint(0, 448, (1, 12), generator=torch.Generator().manual_seed(3))
IDS[IDS == 469] = 0  # no media placeholder without an image


def snapshot(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        p = os.path.join(folder, f)
        out[f] = (hashlib.sha256(open(p, "rb").read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


def logits(folder):
    model = Kimi3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def dequantized_logits(folder):
    """Experts dequantised to bf16 at load (what the converters' own forward check compares)."""
    _, config = load_config(str(folder))
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder))
             if f.endswith(".safetensors") and f != "inputs_and_logits.safetensors"]
    with torch.no_grad():
        return load_model_from_files(config, files)(input_ids=IDS, use_cache=False).logits


def tensors(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors") and f != "inputs_and_logits.safetensors":
            out.update(load_file(os.path.join(folder, f)))
    return out


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def run(tool, *argv):
    return tool.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def ref_logits():
    return {"A": logits(ORACLE_A), "tiny": logits(TINY), "tiny_dequantized": dequantized_logits(TINY)}


@pytest.fixture(scope="module")
def converted_a(tmp_path_factory):
    out = tmp_path_factory.mktemp("a") / "k3"
    before = snapshot(ORACLE_A)
    assert run(K3, ORACLE_A, out, "--quiet") == 0  # with the converter's own forward check
    assert snapshot(ORACLE_A) == before
    return out


# ------------------------------------------------------------------------------------------ convert_k3_to_hf
def test_oracle_a_converts_to_the_same_tensors_logits_code_and_card(converted_a, ref_logits):
    out = converted_a
    src, got = tensors(ORACLE_A), tensors(out)
    assert sorted(src) == sorted(got) and all(same_bytes(src[k], got[k]) for k in src)
    assert torch.equal(logits(out), ref_logits["A"])
    cfg, src_cfg = json.load(open(out / "config.json")), json.load(open(os.path.join(ORACLE_A, "config.json")))
    assert cfg["auto_map"] == K3_AUTO_MAP
    assert cfg["text_config"]["auto_map"] == TEXT_AUTO_MAP
    for d in (cfg, src_cfg):
        d.pop("auto_map")
        d["text_config"].pop("auto_map")
    assert cfg == src_cfg  # otherwise the official config verbatim, quantization_config included
    code = {os.path.basename(f): f for f in code_files("modeling_kimi3")}
    assert {"modeling_kimi3.py", "configuration_kimi3.py", "checkpoint.py", "mxfp4.py"} <= set(code)
    assert set(code) <= set(os.listdir(out))  # (contents: the package's files at conversion time)
    referenced = {ref.split(".")[0] + ".py" for ref in cfg_refs(out)}
    assert referenced <= set(os.listdir(out))
    assert open(out / "README.md", "rb").read() == open(CARD, "rb").read()
    # hidden files: only the manifest, the mark of a converter's output that --overwrite requires
    assert [f for f in os.listdir(out) if f.startswith(".") or f.endswith(".tmp")] == [MANIFEST]
    assert not os.path.exists(partial_dir(out))


def test_converted_folders_load_without_the_package(converted_a, tmp_path, ref_logits):
    """The code files and auto_map the converter writes are enough: trust_remote_code, package not importable."""
    tiny = tmp_path / "tiny"
    assert run(K3, TINY, tiny, "--no-verify", *FAST) == 0
    save_file({"ids": IDS, "a": ref_logits["A"], "tiny": ref_logits["tiny"]}, tmp_path / "io.safetensors")
    code = BLOCK_PACKAGE + f"""
import torch, transformers
from safetensors.torch import load_file
torch.set_num_threads(1)
io = load_file({str(tmp_path / "io.safetensors")!r})
for folder, auto, key in (({str(converted_a)!r}, "AutoModelForImageTextToText", "a"),
                          ({str(tiny)!r}, "AutoModelForCausalLM", "tiny")):
    m = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    assert "transformers_kimi3" not in type(m).__module__ and type(m).__name__ == "Kimi3ForConditionalGeneration"
    with torch.no_grad():
        got = m(input_ids=io["ids"], use_cache=False).logits
    print("REL", key, float((got - io[key]).abs().max() / io[key].abs().max()))
p = transformers.AutoProcessor.from_pretrained({str(tiny)!r}, trust_remote_code=True)
print("PROC", type(p).__name__, type(p.image_processor).__name__, p.tokenizer("hi").input_ids)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rels = [float(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("REL")]
    assert len(rels) == 2 and max(rels) < 1e-5, proc.stdout
    assert "PROC Kimi3Processor Kimi3ImageProcessor" in proc.stdout


def cfg_refs(folder):
    return list(json.load(open(folder / "config.json"))["auto_map"].values())


def test_bundled_dequantized_and_resharded(tmp_path, ref_logits):
    out = tmp_path / "bf16"
    before = snapshot(TINY)
    assert run(K3, TINY, out, "--dequantize", "--max-shard-size", "1MB", *FAST) == 0
    assert snapshot(TINY) == before
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.exists(out / s) for s in shards)
    src, got = tensors(TINY), tensors(out)
    assert set(index["weight_map"]) == set(got)
    assert not any(k.endswith(("weight_packed", "weight_scale")) for k in got)
    n = 0
    for k, v in src.items():
        if k.endswith(".weight_packed"):
            base = k[: -len("_packed")]
            w = got[base]
            assert w.dtype == torch.bfloat16
            assert same_bytes(w, dequantize_mxfp4(v, src[base + "_scale"], torch.bfloat16))
            n += 1
        elif not k.endswith(".weight_scale"):
            assert same_bytes(v, got[k]), k
    assert n == 168
    # bf16 experts vs MXFP4 experts computed packed: same values, other kernels; both dequantised: identical
    assert rel_err(logits(out), ref_logits["tiny"]) < 1e-4
    assert torch.equal(dequantized_logits(out), ref_logits["tiny_dequantized"])
    cfg = json.load(open(out / "config.json"))
    assert "quantization_config" not in cfg["text_config"] and cfg["auto_map"] == K3_AUTO_MAP
    for f in ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        assert open(out / f, "rb").read() == open(os.path.join(TINY, f), "rb").read(), f
    proc = json.load(open(out / "processor_config.json"))
    assert proc["auto_map"]["AutoProcessor"] == "processing_kimi3.Kimi3Processor"
    processor_code = {os.path.basename(f) for f in code_files("processing_kimi3")}  # with its relative imports
    assert {"processing_kimi3.py", "image_processing_kimi3.py"} | processor_code <= set(os.listdir(out))

    # quantize_mxfp4 back: the experts dequantise to the source's values, the config says MXFP4 again
    q = tmp_path / "mxfp4"
    assert run(Q, out, q, *FAST) == 0
    assert load_manifest(q)["tool"] == "quantize_mxfp4"  # its own manifest, not the one of the source folder
    back = tensors(q)
    assert sorted(back) == sorted(src)
    for k, v in src.items():
        if k.endswith(".weight_packed"):
            s = k[: -len("packed")] + "scale"
            assert back[k].dtype == torch.uint8 and back[s].dtype == torch.uint8
            assert torch.equal(dequantize_mxfp4(back[k], back[s], torch.float32),
                               dequantize_mxfp4(v, src[s], torch.float32)), k
        elif not k.endswith(".weight_scale"):
            assert same_bytes(v, back[k]), k
    oracle_q = json.load(open(os.path.join(ORACLE_A, "config.json")))["text_config"]["quantization_config"]
    assert json.load(open(q / "config.json"))["text_config"]["quantization_config"] == oracle_q
    assert rel_err(logits(q), ref_logits["tiny"]) < 1e-4
    assert torch.equal(dequantized_logits(q), ref_logits["tiny_dequantized"])


def test_dry_run_writes_nothing_and_existing_output_is_kept(tmp_path, capsys):
    listing = sorted(os.listdir(tmp_path))
    assert run(K3, TINY, tmp_path / "out", "--dry-run") == 0
    assert "nothing was written" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == listing
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    assert run(K3, TINY, tmp_path / "out", *FAST) == 1
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == ["keep"]
    os.remove(tmp_path / "out" / "keep")  # an empty folder is replaced with --overwrite
    assert run(K3, TINY, tmp_path / "out", "--overwrite", "--no-verify", *FAST) == 0
    assert "config.json" in os.listdir(tmp_path / "out")
    assert run(K3, TINY, TINY + "/sub", "--dry-run") == 1  # output inside the source
    capsys.readouterr()
    # a stale partial folder of ours is discarded without --resume; anything else in its place is refused
    partial = partial_dir(tmp_path / "new")
    os.makedirs(partial)
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump({"tool": "convert_k3_to_hf", "fingerprint": "old", "shards": {}}, f)
    open(os.path.join(partial, "model.safetensors.tmp"), "w").write("half")
    assert run(K3, TINY, tmp_path / "new", "--no-verify", "--quiet") == 0
    assert not os.path.exists(partial) and os.path.exists(tmp_path / "new" / "config.json")
    os.makedirs(partial_dir(tmp_path / "other"))
    open(os.path.join(partial_dir(tmp_path / "other"), "mine"), "w").write("x")
    assert run(K3, TINY, tmp_path / "other", *FAST) == 1
    assert "was not made by this tool" in capsys.readouterr().err
    assert os.listdir(partial_dir(tmp_path / "other")) == ["mine"]  # not ours: left as it was


def _help(command, cwd):
    proc = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert proc.returncode == 0, (command, proc.stderr)
    for opt in ("--dry-run", "--resume", "--verify", "--no-verify", "--max-shard-size", "--overwrite"):
        assert opt in proc.stdout, (command, opt)
    return proc.stdout


@pytest.mark.parametrize("cwd", ["root", "elsewhere"])
def test_help_for_every_script(cwd, tmp_path):
    """`python conversion/<script>.py --help` from the repository root and from another folder."""
    for script in SCRIPTS:
        out = _help([sys.executable, script], ROOT if cwd == "root" else tmp_path)
        assert ("\n  --dequantize" in out) == script.endswith("convert_k3_to_hf.py")


def test_help_for_every_console_script(tmp_path):
    """The console scripts setup.py installs (`pip install -e .`) run the same commands."""
    for name, script in zip(CONSOLE_SCRIPTS, SCRIPTS):
        exe = os.path.join(os.path.dirname(sys.executable), name)
        assert os.path.exists(exe), f"{exe} is not installed: run `pip install -e .`"
        # the same parser: only the usage lines, which name the program, differ
        assert _help([exe], tmp_path).split("\n\n", 1)[1] == _help([sys.executable, script], tmp_path).split(
            "\n\n", 1)[1]


# ------------------------------------------------------------------------------------------ kill and resume
# convert_k3_to_hf in a child process whose shard writer is patched: the `park`-th shard it writes (0-based) stops
# after half of its tensors and the process sleeps until the test kills it with SIGKILL.
PARK_AT_SHARD = """
import sys, time
from kimi3_conversion import convert_k3_to_hf, runner

park, started, write_shard = int(sys.argv[1]), [], runner.write_shard


def parking(produce, after):
    produced = []

    def produce_then_park(t):
        if len(produced) == after:
            while True:
                time.sleep(60)
        produced.append(t.name)
        return produce(t)

    return produce_then_park


def write_shard_and_park(path, specs, produce, progress):
    started.append(path)
    if len(started) - 1 == park:
        produce = parking(produce, len(specs) // 2)
    return write_shard(path, specs, produce, progress)


runner.write_shard = write_shard_and_park
sys.exit(convert_k3_to_hf.main(sys.argv[2:]))
"""


def test_sigkill_leaves_nothing_complete_and_resume_finishes(tmp_path, ref_logits, capsys):
    src = tmp_path / "src"  # the bundled checkpoint re-sharded into ~10 files
    assert run(K3, TINY, src, "--max-shard-size", "300KB", "--no-verify", *FAST) == 0
    n_shards = len(set(json.load(open(src / "model.safetensors.index.json"))["weight_map"].values()))
    assert n_shards >= 6
    before = snapshot(src)
    out = tmp_path / "out"
    partial = partial_dir(out)
    park = 3  # the converter stops half-way through its 4th shard and waits to be killed
    proc = subprocess.Popen([sys.executable, "-c", PARK_AT_SHARD, str(park), str(src), str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            manifest = load_manifest(partial) if os.path.isdir(partial) else None
            half = os.path.isdir(partial) and any(f.endswith(".tmp") for f in os.listdir(partial))
            if manifest and len(manifest["shards"]) == park and half:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        else:
            pytest.fail("the converter never reached its parking point")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(out)
    left = os.listdir(partial)
    assert "config.json" not in left and INDEX not in left  # nothing that looks loadable
    assert any(f.endswith(".tmp") for f in left)  # it really was killed mid-shard

    assert run(K3, src, out, "--resume", *FAST) == 0  # bit-for-bit verification included
    assert f"({n_shards - park} written, {park} kept from an interrupted run)" in capsys.readouterr().out
    assert not os.path.exists(partial)
    a, b = tensors(src), tensors(out)
    assert sorted(a) == sorted(b) and all(same_bytes(a[k], b[k]) for k in a)
    assert torch.equal(logits(out), ref_logits["tiny"])
    assert snapshot(src) == before


# ------------------------------------------------------------------------------------------ bad inputs
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.3.w1"
Q_PROJ = "language_model.model.layers.0.self_attn.q_proj.weight"


def _mutate_tensors(kind, sd):
    if kind == "wrong_dtype":
        sd[Q_PROJ] = sd[Q_PROJ].to(torch.float16)
        return Q_PROJ, ["dtype F16", "BF16"]
    if kind == "missing":
        del sd["language_model.model.norm.weight"]
        return "language_model.model.norm.weight", ["missing"]
    if kind == "unexpected":
        sd["language_model.model.layers.0.self_attn.extra.weight"] = torch.zeros(4, dtype=torch.bfloat16)
        return "language_model.model.layers.0.self_attn.extra.weight", ["unexpected tensor"]
    if kind == "nan_scale":
        s = sd[EXPERT + ".weight_scale"].clone()
        s[5, 1] = 0xFF
        sd[EXPERT + ".weight_scale"] = s
        return EXPERT + ".weight_scale", ["0xFF", "NaN"]
    if kind == "expert_shape":
        sd[EXPERT + ".weight_packed"] = sd[EXPERT + ".weight_packed"][:32].clone()
        sd[EXPERT + ".weight_scale"] = sd[EXPERT + ".weight_scale"][:32].clone()
        return EXPERT + ".weight_packed", ["shape [32, 32]", "config implies [64, 32]", "moe_intermediate_size"]
    if kind == "non_finite":
        w = sd[Q_PROJ].clone()
        w[3, 4] = float("nan")
        sd[Q_PROJ] = w
        return Q_PROJ, ["non-finite"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "corrupt", "wrong_dtype", "missing", "unexpected", "nan_scale",
                                  "expert_shape", "non_finite", "pickle"])
def test_bad_input_is_refused_naming_tensor_and_file(tmp_path, kind, capsys):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(os.path.join(TINY, "config.json"), src / "config.json")
    weights = src / "model.safetensors"
    tensor = None
    if kind == "truncated":
        data = open(os.path.join(TINY, "model.safetensors"), "rb").read()
        weights.write_bytes(data[:-1000])
        expect = ["truncated"]
    elif kind == "corrupt":
        data = bytearray(open(os.path.join(TINY, "model.safetensors"), "rb").read())
        data[20:60] = bytes(range(200, 240))  # not UTF-8: the JSON header is garbage
        weights.write_bytes(bytes(data))
        expect = ["corrupt"]
    elif kind == "pickle":
        (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
        weights = src / "pytorch_model.bin"
        expect = ["pickled weights are never loaded"]
    else:
        sd = load_file(os.path.join(TINY, "model.safetensors"))
        tensor, expect = _mutate_tensors(kind, sd)
        save_file(sd, weights, metadata={"format": "pt"})
    before = snapshot(src)
    out = tmp_path / "out"
    for tool, extra in ((K3, []), (K3, ["--dry-run"]), (K3, ["--dequantize"])):
        assert run(tool, src, out, *FAST, *extra) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ")
        for frag in expect + ([tensor] if tensor else []) + [os.path.basename(weights)]:
            assert frag in err, (kind, frag, err)
        assert not os.path.exists(out) and not os.path.exists(partial_dir(out))
    assert snapshot(src) == before


# ------------------------------------------------------------------------------------------ Kimi Linear
def test_convert_kimi_linear_from_native_save(tmp_path):
    from transformers_kimi3 import Kimi3ForCausalLM

    native = native_kimi_linear(q_lora_rank=24)
    native.save_pretrained(tmp_path / "native")
    before = snapshot(tmp_path / "native")
    out = tmp_path / "ours"
    assert run(KL, tmp_path / "native", out, *FAST) == 0
    assert snapshot(tmp_path / "native") == before
    ids = torch.randint(3, 80, (2, 17), generator=torch.Generator().manual_seed(4))
    model = Kimi3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref, got = native(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    # the converter writes what Kimi3ForCausalLM.save_pretrained writes
    Kimi3ForCausalLM.from_pretrained(tmp_path / "native").save_pretrained(tmp_path / "ref")
    assert sorted(set(os.listdir(out)) - {MANIFEST}) == sorted(os.listdir(tmp_path / "ref"))
    for f in ("config.json", "generation_config.json"):
        a, b = json.load(open(out / f)), json.load(open(tmp_path / "ref" / f))
        assert a == b, f
    a, b = tensors(out), tensors(tmp_path / "ref")
    assert sorted(a) == sorted(b) and all(same_bytes(a[k], b[k]) for k in a)
    assert any(".mlp.gate_proj" in k for k in a) and not any("block_sparse_moe.gate_proj" in k for k in a)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # the official layout (what we just wrote) converts to itself
    assert run(KL, out, tmp_path / "again", *FAST) == 0
    c = tensors(tmp_path / "again")
    assert sorted(a) == sorted(c) and all(same_bytes(a[k], c[k]) for k in a)
    assert json.load(open(tmp_path / "again" / "config.json")) == json.load(open(out / "config.json"))


def test_quantize_and_kimi_linear_refuse_bad_inputs(tmp_path, capsys):
    bf16 = tmp_path / "bf16"
    assert run(K3, TINY, bf16, "--dequantize", "--no-verify", *FAST) == 0
    sd = load_file(bf16 / "model.safetensors")
    w = sd[EXPERT + ".weight"].clone()
    w[0, 7] = float("inf")
    sd[EXPERT + ".weight"] = w
    save_file(sd, bf16 / "model.safetensors", metadata={"format": "pt"})
    assert run(Q, bf16, tmp_path / "q", *FAST) == 1
    err = capsys.readouterr().err
    assert EXPERT + ".weight in " in err and "model.safetensors" in err and "non-finite" in err
    assert not os.path.exists(tmp_path / "q") and not os.path.exists(partial_dir(tmp_path / "q"))
    assert run(Q, TINY, tmp_path / "q", *FAST) == 1  # already MXFP4
    assert "already MXFP4" in capsys.readouterr().err
    assert run(KL, TINY, tmp_path / "kl", *FAST) == 1
    assert "use convert_k3_to_hf.py" in capsys.readouterr().err

    native = tmp_path / "native"
    native_kimi_linear(q_lora_rank=24).save_pretrained(native)
    sd = load_file(native / "model.safetensors")
    del sd["model.layers.1.self_attn.q_proj.weight"]
    sd["model.layers.1.self_attn.bogus.weight"] = torch.zeros(3)
    save_file(sd, native / "model.safetensors", metadata={"format": "pt"})
    assert run(KL, native, tmp_path / "kl", *FAST) == 1
    err = capsys.readouterr().err
    assert "model.layers.1.self_attn.q_proj.weight: missing" in err and "not in model.safetensors" in err
    assert "model.layers.1.self_attn.bogus.weight in model.safetensors: unexpected tensor" in err
    assert not os.path.exists(tmp_path / "kl") and not os.path.exists(partial_dir(tmp_path / "kl"))


def test_official_tokenizer_is_converted(tmp_path):
    """A K3 folder with only tiktoken.model and Moonshot's remote tokenizer class gets our converted fast tokenizer."""
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    shutil.copytree(TINY, src)
    os.remove(src / "tokenizer.json")
    cfg = json.load(open(src / "tokenizer_config.json"))
    cfg.update(tokenizer_class="TikTokenTokenizer", auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                                None]})
    json.dump(cfg, open(src / "tokenizer_config.json", "w"))
    (src / "tokenization_kimi.py").write_text("raise ImportError('Moonshot remote code: must not be carried over')\n")
    out = tmp_path / "out"
    assert run(K3, src, out, "--no-verify", *FAST) == 0
    assert "tokenization_kimi.py" not in os.listdir(out) and "tokenizer.json" in os.listdir(out)
    assert "auto_map" not in json.load(open(out / "tokenizer_config.json"))
    text = "Kimi K3 converts <|media_pad|> and [BOS] text."
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == AutoTokenizer.from_pretrained(TINY)(text).input_ids


def test_bundled_mini_folders_pass_the_converters_checks(tmp_path, capsys):
    """The trained mini's folder is a K3 checkpoint the K3 converter accepts (dtypes as its config implies); its
    text-only draft is refused by both converters with the reason (it loads as it is), not a traceback."""
    mini, draft = (os.path.join(ROOT, "assets", n) for n in ("kimi-k3-mini", "kimi-k3-mini-draft"))
    assert run(K3, mini, tmp_path / "k3", "--dry-run", *FAST) == 0, capsys.readouterr().err[-2000:]
    for tool in (K3, KL):
        assert run(tool, draft, tmp_path / "d", "--dry-run", *FAST) == 1
        err = capsys.readouterr().err
        assert "text-only Kimi K3 folder" in err and "nothing to convert" in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "k3") and not os.path.exists(tmp_path / "d")
