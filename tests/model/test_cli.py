"""`python -m transformers_kimi3`: the demo finds the bundled model from any working folder without the network,
every option is described in --help, the parameter count is the model card's, and bench writes nothing."""

import argparse
import copy
import os
import re
import tempfile
from types import SimpleNamespace

import pytest
import torch

from kimi3_testing import ROOT
from transformers_kimi3 import Kimi3ForConditionalGeneration
from transformers_kimi3 import __main__ as cli
from transformers_kimi3 import benchmark

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")
MINI = os.path.join(ROOT, "assets", "kimi-k3-mini")  # the demo's default
CARDS = [os.path.join(ROOT, "model_cards", "kimi-k3-tiny.md"), os.path.join(TINY, "README.md")]


def test_default_model_resolves_from_any_folder_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = cli.build_parser().parse_args(["demo"])
    assert os.path.samefile(cli.resolve_model(args.model), MINI)
    assert cli.resolve_model("someone/some-model") == "someone/some-model"  # a given --model is taken as is


def test_missing_bundled_model_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "REPO_ROOT", str(tmp_path / "site-packages"))
    with pytest.raises(SystemExit) as e:
        cli.resolve_model(None)
    msg = str(e.value)
    assert str(tmp_path / "site-packages" / "assets" / "kimi-k3-mini") in msg and "--model" in msg


def _parsers(ap):
    yield ap
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_describes_every_option():
    for ap in _parsers(cli.build_parser()):
        text = ap.format_help()
        for action in ap._actions:
            assert action.help and action.help != argparse.SUPPRESS, (ap.prog, action.dest)
            for opt in action.option_strings:
                assert opt in text, (ap.prog, opt)


def test_parameter_count_is_the_model_cards():
    """Packed MXFP4 experts count 2 values per byte, scales not at all: the same number as the model with float
    experts, and the number the cards print."""
    model = Kimi3ForConditionalGeneration.from_pretrained(TINY)
    packed = sum(b.numel() for n, b in model.named_buffers() if n.endswith("_packed"))
    assert packed > 0
    n = cli.parameter_count(model)
    assert n == sum(p.numel() for p in model.parameters()) + 2 * packed
    config = copy.deepcopy(model.config)
    config.text_config.checkpoint_quantization_config = None
    with torch.device("meta"):
        assert n == sum(p.numel() for p in Kimi3ForConditionalGeneration(config).parameters())
    for card in CARDS:
        stated = re.findall(r"([\d.]+)M parameters", open(card, encoding="utf-8").read())
        assert stated == [f"{n / 1e6:.2f}"], card


def test_bench_writes_nothing_and_names_rows_by_what_ran(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        benchmark.main(SimpleNamespace(device="cpu", prefill="8", batches="1", new_tokens=2))
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "decode, dynamic cache" in out and "decode, static cache" in out and "graph" not in out
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")] == []


def test_demo_runs_our_class_on_a_kimi_linear_folder_and_names_bad_input(tmp_path, capsys, monkeypatch):
    """A Kimi Linear folder (native layout) demos with our Kimi3ForCausalLM: the Auto classes would give
    Transformers' native class, whose KDA needs fla's GPU kernels. A missing folder, an empty prompt and a device
    this torch cannot use end with one `error:` line, not a traceback."""
    from kimi3_testing import native_kimi_linear

    native_kimi_linear().save_pretrained(tmp_path / "kl")
    cli.main(["demo", "--model", str(tmp_path / "kl"), "--max-new-tokens", "3"])
    assert "model: Kimi3ForCausalLM" in capsys.readouterr().out
    os.makedirs(tmp_path / "assets")
    monkeypatch.chdir(tmp_path)  # "assets/typo": under a folder that exists here, so a path, not a Hub id
    for argv, message in ((["demo", "--model", str(tmp_path / "missing")], "no such folder"),
                          (["demo", "--model", "assets/typo"], "no such folder"),
                          (["demo", "--model", TINY, "--prompt", ""], "input_ids has no tokens")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert str(e.value).startswith("error: ") and message in str(e.value), str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="error: --device cuda: this torch build sees no CUDA device"):
            cli.main(["bench", "--device", "cuda"])


def test_plan_wants_a_unit_for_memory_sizes():
    for flag in ("--gpu-memory", "--host-memory"):
        with pytest.raises(SystemExit, match=f"error: {flag} 140: give a unit, e.g. 140GiB"):
            cli.main(["plan", flag, "140"])
