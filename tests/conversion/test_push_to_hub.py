"""push_to_hub on a converted K3 model uploads exactly what save_pretrained writes (code files, auto_map config,
shards) plus the model card, without any network access: huggingface_hub's repo / commit API is replaced by
recorders and every HTTP request fails the test."""

import json
import os
import socket
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from huggingface_hub import CommitOperationAdd, ModelCard

from kimi3_conversion import convert_k3_to_hf as K3
from kimi3_conversion.k3_job import K3_AUTO_MAP
from kimi3_testing import ORACLE_A, ROOT
from transformers_kimi3 import Kimi3ForConditionalGeneration

CARD = os.path.join(ROOT, "model_cards", "kimi-k3.md")
REPO = "someone/kimi-k3-converted"


class HubRecorder:
    """Stands in for the Hub: records create_repo and the operations of every commit (with the bytes uploaded)."""

    def __init__(self, card_on_hub):
        self.card_on_hub = card_on_hub
        self.repos, self.commits = [], []

    def create_repo(self, api, repo_id, *args, **kwargs):
        self.repos.append(repo_id)
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, api, repo_id, operations, *args, **kwargs):
        files = {}
        for op in operations:
            assert isinstance(op, CommitOperationAdd), op
            src = op.path_or_fileobj
            files[op.path_in_repo] = open(src, "rb").read() if isinstance(src, (str, os.PathLike)) else bytes(src)
        self.commits.append({"repo_id": repo_id, "files": files, "message": kwargs.get("commit_message")})
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0", oid="0" * 40)

    def load_card(self, repo_id_or_path, *args, **kwargs):
        if self.card_on_hub is None:
            from huggingface_hub.errors import EntryNotFoundError

            raise EntryNotFoundError("no README.md in the repo")
        return ModelCard(self.card_on_hub)


@pytest.fixture
def hub(monkeypatch):
    def install(card_on_hub):
        rec = HubRecorder(card_on_hub)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                            lambda self, repo_id, *a, **k: rec.create_repo(self, repo_id, *a, **k))
        monkeypatch.setattr(huggingface_hub.HfApi, "create_commit",
                            lambda self, repo_id, operations, *a, **k: rec.create_commit(self, repo_id, operations,
                                                                                         *a, **k))
        monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", lambda self, *a, **k: None)
        monkeypatch.setattr(ModelCard, "load", classmethod(lambda cls, repo, *a, **k: rec.load_card(repo, *a, **k)))
        return rec

    def no_network(*args, **kwargs):
        raise AssertionError("push_to_hub tried to reach the network")

    # whatever HTTP client huggingface_hub uses, it ends in a socket
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_not_used")
    return install


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("hub") / "k3"
    assert K3.main([ORACLE_A, str(out), "--quiet", "--forward-check-max-gb", "0"]) == 0
    return out


def _saved(model, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    return {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}


@pytest.mark.parametrize("card_on_hub", ["ours", None])
def test_push_to_hub_uploads_exactly_what_save_pretrained_writes(converted, tmp_path, hub, card_on_hub):
    card_text = open(CARD).read() if card_on_hub == "ours" else None
    rec = hub(card_text)
    model = Kimi3ForConditionalGeneration.from_pretrained(converted, dtype=torch.bfloat16)
    saved = _saved(model, tmp_path / "saved", max_shard_size="1MB")
    model.push_to_hub(REPO, max_shard_size="1MB")

    assert rec.repos == [REPO] and len(rec.commits) == 1 and rec.commits[0]["repo_id"] == REPO
    uploaded = rec.commits[0]["files"]
    assert set(uploaded) == set(saved) | {"README.md"}
    for name, data in saved.items():
        assert uploaded[name] == data, name  # byte for byte: shards, index, config, generation config, code

    # what save_pretrained writes is the converted folder's content: official layout, our code, our auto_map
    config = json.loads(uploaded["config.json"])
    assert config["auto_map"] == K3_AUTO_MAP
    assert {ref.split(".")[0] + ".py" for ref in config["auto_map"].values()} <= set(uploaded)
    assert {f for f in os.listdir(converted) if f.endswith(".py")} == {f for f in uploaded if f.endswith(".py")}
    index = json.loads(uploaded["model.safetensors.index.json"])
    shards = {f for f in uploaded if f.endswith(".safetensors")}
    assert len(shards) > 1 and set(index["weight_map"].values()) == shards
    assert any(k.endswith(".experts.0.w1.weight") for k in index["weight_map"]) or any(
        k.endswith(".experts.0.w1.weight_packed") for k in index["weight_map"])
    assert all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in index["weight_map"])

    card = ModelCard(uploaded["README.md"].decode())
    if card_on_hub == "ours":  # the card the converter published stays the repo's card
        ours = ModelCard(card_text)
        assert card.text == ours.text and card.data.to_dict() == ours.data.to_dict()
        assert card.data.to_dict()["pipeline_tag"] == "image-text-to-text"
    else:  # a new repo gets Transformers' generated card
        assert card.data.to_dict().get("library_name") == "transformers"


def test_converted_folder_is_what_gets_published(converted, tmp_path, hub):
    """The converter's output holds the card and everything save_pretrained of the loaded model writes, by name."""
    hub(None)
    model = Kimi3ForConditionalGeneration.from_pretrained(converted, dtype=torch.bfloat16)
    saved = _saved(model, tmp_path / "saved")
    assert set(saved) <= set(os.listdir(converted))
    assert open(converted / "README.md").read() == open(CARD).read()
    for name in saved:
        if name.endswith(".py") or name == "generation_config.json":
            assert saved[name] == open(converted / name, "rb").read(), name
    assert json.loads(saved["config.json"])["auto_map"] == json.load(open(converted / "config.json"))["auto_map"]
