"""Transformers' own common model tests, from the source distribution of the installed Transformers version.

The sdist ships the top-level `tests/*.py` of Transformers (`test_modeling_common.py` with `ModelTesterMixin`,
`test_configuration_common.py` with `ConfigTester`, ...), not `tests/generation/`, `tests/exporters/`,
`tests/utils/` nor `tests/causal_lm_tester.py`. `load()` fetches the sdist with pip once per version into a cache
folder outside the repository, checks that it is that version, extracts `tests/*.py` as the package
`transformers_upstream_tests` and imports the requested module. The modules the shipped files import from the
folders that are not shipped get stand-ins here (`_STAND_INS`): `GenerationTesterMixin` is ours
(generation_tester.py), covering the behaviours Transformers' generation tester checks. Nothing of Transformers is
copied into this repository.

Not a test module: the test modules of this folder import it (pytest puts a test file's folder on sys.path).
"""

import contextlib
import importlib
import os
import subprocess
import sys
import tarfile
import types

import pytest
import torch
import transformers

PACKAGE = "transformers_upstream_tests"
VERSION = transformers.__version__
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                     "transformers-kimi3", f"transformers-{VERSION}")
SDIST = os.path.join(CACHE, f"transformers-{VERSION}.tar.gz")
FETCH = f"{sys.executable} -m pip download --no-deps --no-binary :all: transformers=={VERSION} -d {CACHE}"


class _ExportTesterMixin:
    """Stand-in for `tests/exporters/test_export.ExportTesterMixin` (not in the sdist): its torch.export tests are
    not run (torch.export of the hybrid cache is not supported; see test_common_text.py)."""


# tests/utils/test_configuration_utils.config_common_kwargs (not in the sdist): the PretrainedConfig arguments
# ConfigTester.check_config_arguments_init sets to non-default values and reads back. Ours, not a copy.
_CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["Kimi3ForCausalLM"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
    "tie_word_embeddings": True,
}

_STAND_INS = {
    "generation": {},
    "generation.test_utils": {"GenerationTesterMixin": None},  # generation_tester.GenerationTesterMixin
    "exporters": {},
    "exporters.test_export": {"ExportTesterMixin": _ExportTesterMixin},
    "utils": {},
    "utils.test_configuration_utils": {"config_common_kwargs": _CONFIG_COMMON_KWARGS},
}


@contextlib.contextmanager
def _locked(path):
    """An exclusive lock on `path` (pytest-xdist workers fetch and extract once between them)."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sdist_version(path):
    with tarfile.open(path) as tar:
        info = tar.extractfile(f"transformers-{VERSION}/PKG-INFO")
        for line in info.read().decode().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def _prepare():
    """The folder holding the package `transformers_upstream_tests`, fetched and extracted if needed; skips the
    calling module with the command to run when the sdist cannot be had."""
    root = os.path.join(CACHE, "extracted")
    done = os.path.join(root, PACKAGE, "__init__.py")
    if os.path.exists(done):
        return root
    with _locked(os.path.join(CACHE, ".lock")):
        if os.path.exists(done):
            return root
        if not os.path.exists(SDIST):
            run = subprocess.run(FETCH.split(), capture_output=True, text=True, timeout=600)
            if run.returncode or not os.path.exists(SDIST):
                tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or [""]
                pytest.skip(f"Transformers' common tests need the transformers {VERSION} source distribution, which "
                            f"could not be fetched ({tail[0]}); fetch it with: {FETCH}", allow_module_level=True)
        found = _sdist_version(SDIST)
        if found != VERSION:
            raise RuntimeError(f"{SDIST} holds transformers {found}, the installed version is {VERSION}: delete it "
                               f"and fetch again with: {FETCH}")
        staging = root + ".partial"
        package = os.path.join(staging, PACKAGE)
        os.makedirs(package, exist_ok=True)
        prefix = f"transformers-{VERSION}/tests/"
        with tarfile.open(SDIST) as tar:
            for member in tar.getmembers():
                name = member.name[len(prefix):] if member.name.startswith(prefix) else None
                if member.isfile() and name and "/" not in name and name.endswith(".py"):
                    with tar.extractfile(member) as src, open(os.path.join(package, name), "wb") as dst:
                        dst.write(src.read())
        if not os.path.exists(os.path.join(package, "test_modeling_common.py")):
            raise RuntimeError(f"{SDIST} has no tests/test_modeling_common.py")
        open(os.path.join(package, "__init__.py"), "w").close()
        if os.path.exists(root):
            os.rename(root, root + f".old{os.getpid()}")
        os.rename(staging, root)
    return root


class Registered:
    """Mixin for a unittest.TestCase: while its tests run, our classes are in Transformers' model-name mappings, as
    a model inside Transformers is (the common tests find a class's role there: base model, causal LM,
    image-text-to-text; labels and loss checks depend on it). The mappings are restored after the class.

    The class's tests also run with one intra-op thread: the models are tiny, and on a machine whose cores are all
    busy (pytest-xdist, one worker per core) a second thread only adds waiting (a forward took 7x the CPU time).
    And tensors print summarised (one item per edge): some mixin tests format every parameter into an assertion
    message before comparing (test_bc_torch_dtype spent 5 s of 12 there). Both are restored after the class."""

    registered_names = {
        "MODEL_MAPPING_NAMES": {"kimi_k3_text": "Kimi3Model"},
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": {"kimi_k3_text": "Kimi3ForCausalLM"},
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES": {"kimi_k3": "Kimi3ForConditionalGeneration"},
    }

    @classmethod
    def setUpClass(cls):
        from unittest import mock

        from transformers.models.auto import modeling_auto

        super().setUpClass()
        cls._registration = contextlib.ExitStack()
        for mapping, names in cls.registered_names.items():
            cls._registration.enter_context(mock.patch.dict(getattr(modeling_auto, mapping), names))
        cls._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        torch.set_printoptions(threshold=1, edgeitems=1)

    @classmethod
    def tearDownClass(cls):
        torch.set_printoptions(profile="default")
        torch.set_num_threads(cls._threads)
        cls._registration.close()
        super().tearDownClass()


def load(module):
    """`transformers_upstream_tests.<module>` (e.g. "test_modeling_common"), imported from the sdist."""
    root = _prepare()
    if root not in sys.path:
        sys.path.append(root)
    from generation_tester import GenerationTesterMixin

    _STAND_INS["generation.test_utils"]["GenerationTesterMixin"] = GenerationTesterMixin
    for name, attrs in _STAND_INS.items():
        full = f"{PACKAGE}.{name}"
        if full not in sys.modules:
            stand_in = types.ModuleType(full)
            stand_in.__dict__.update(attrs)
            stand_in.__path__ = [] if "." not in name else None
            if stand_in.__path__ is None:
                del stand_in.__path__
            sys.modules[full] = stand_in
    return importlib.import_module(f"{PACKAGE}.{module}")
