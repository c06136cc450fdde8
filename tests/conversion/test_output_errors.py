"""The converters' output path: --overwrite replaces only a converter's output, too little free space is refused
before anything is written, an OSError (disk full, no permission) is one line on stderr and leaves a partial folder
that --resume finishes, and --quiet hides Transformers' progress bars too."""

import errno
import json
import os
import shutil
import stat

import pytest
import torch
from transformers.utils import logging as hf_logging

from kimi3_conversion import convert_k3_to_hf as K3
from kimi3_conversion import runner
from kimi3_conversion.resume import MANIFEST, load_manifest, partial_dir
from kimi3_testing import ROOT

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")
FAST = ["--quiet", "--no-verify"]


def run(*argv):
    return K3.main([str(a) for a in argv])


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_overwrite_replaces_only_a_converters_output(tmp_path, capsys):
    out = tmp_path / "out"
    assert run(TINY, out, *FAST) == 0
    assert load_manifest(out)["tool"] == "convert_k3_to_hf"  # the mark --overwrite looks for
    assert run(TINY, out, "--overwrite", *FAST) == 0
    capsys.readouterr()

    other = tmp_path / "photos"
    other.mkdir()
    (other / "holiday.jpg").write_text("x")
    assert run(TINY, other, "--overwrite", *FAST) == 1
    line = one_error_line(capsys.readouterr().err)
    assert str(other) in line and "not a folder written by these converters" in line and MANIFEST in line
    assert os.listdir(other) == ["holiday.jpg"]

    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    for extra in ([], ["--overwrite"]):
        assert run(TINY, target, *extra, *FAST) == 1
        line = one_error_line(capsys.readouterr().err)
        assert str(target) in line and "is not a folder" in line
    assert target.read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "out", "photos"]  # no partial folder, no *.old-PID


def _fake_disk(monkeypatch, free):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))


def test_too_little_free_space_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    _fake_disk(monkeypatch, 10**6)
    out = tmp_path / "out"
    assert run(TINY, out, *FAST) == 1
    line = one_error_line(capsys.readouterr().err)
    shards = os.path.getsize(os.path.join(TINY, "model.safetensors"))  # the output dtypes are the source's
    need = float(line.split("needs ")[1].split(" GB")[0])
    assert line.startswith("error: not enough free space for the output: needs ")
    assert f"0.001 GB free at {tmp_path}" in line and need * 1e9 >= shards
    assert os.listdir(tmp_path) == []
    assert run(TINY, out, "--dry-run", "--quiet") == 0  # the dry run reports it and writes nothing
    assert "not enough: a real run would be refused" in capsys.readouterr().out


def _disk_full_in_shard(monkeypatch, index):
    """runner.write_shard raises ENOSPC half-way through the `index`-th shard it writes (0-based)."""
    write_shard, calls = runner.write_shard, []

    def full_disk(path, specs, produce, progress):
        calls.append(path)
        if len(calls) - 1 != index:
            return write_shard(path, specs, produce, progress)
        done = []

        def produce_until_full(t):
            if len(done) == len(specs) // 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done.append(t)
            return produce(t)

        return write_shard(path, specs, produce_until_full, progress)

    monkeypatch.setattr(runner, "write_shard", full_disk)


def test_disk_full_is_one_line_and_resume_finishes(tmp_path, capfd, monkeypatch):
    out = tmp_path / "out"
    sharding = ["--max-shard-size", "300KB"]
    _disk_full_in_shard(monkeypatch, 2)
    assert run(TINY, out, *sharding, *FAST) == 1
    line = one_error_line(capfd.readouterr().err)
    partial = partial_dir(out)
    assert line.startswith(f"error: writing the output: {partial}{os.sep}model-00003-of-")
    assert ".safetensors: No space left on device; rerun with --resume" in line
    assert not os.path.exists(out) and len(load_manifest(partial)["shards"]) == 2
    assert not any(f.endswith(".tmp") for f in os.listdir(partial))  # the half shard's space is given back
    monkeypatch.undo()

    # with verification and the forward check (which loads models through Transformers): quiet is silent
    assert run(TINY, out, *sharding, "--resume", "--quiet") == 0
    got = capfd.readouterr()
    assert got.err == "" and "2 kept from an interrupted run" in got.out and "forward check: logits" in got.out
    assert hf_logging.is_progress_bar_enabled()  # restored after the run
    assert not os.path.exists(partial) and os.path.exists(out / "config.json")


def _make_read_only(folder, how, monkeypatch):
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root ignores file permissions")
        os.chmod(folder, stat.S_IRUSR | stat.S_IXUSR)
        return lambda: os.chmod(folder, stat.S_IRWXU)
    makedirs = os.makedirs

    def refuse_inside(path, *args, **kwargs):
        if os.path.abspath(path).startswith(str(folder) + os.sep):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", refuse_inside)
    return monkeypatch.undo


@pytest.mark.parametrize("how", ["chmod", "permission_error"])
def test_read_only_target_is_one_line_and_resume_finishes(tmp_path, capsys, monkeypatch, how):
    folder = tmp_path / "read_only"
    folder.mkdir()
    out = folder / "out"
    restore = _make_read_only(folder, how, monkeypatch)
    try:
        assert run(TINY, out, *FAST) == 1
    finally:
        restore()
    line = one_error_line(capsys.readouterr().err)
    assert line == f"error: creating the partial output: {partial_dir(out)}: Permission denied"
    assert os.listdir(folder) == []
    assert run(TINY, out, "--resume", *FAST) == 0
    assert json.load(open(out / "config.json"))["model_type"] == "kimi_k3"
