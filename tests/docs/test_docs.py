"""Every Python block of README.md, docs/*.md and model_cards/*.md runs, on the CPU and without the network.

Convention: a ```python block whose first line is `# needs: gpu`, `# needs: hub` or `# needs: gpu, hub` needs a CUDA
GPU or the Hugging Face Hub, and is skipped here (a `gpu`-only block runs where CUDA is available); every other
block must run. The blocks of one file run in order in one namespace, so a later block may use what an earlier one
defined (and must carry the marks of any marked block it depends on). Each file runs in a subprocess whose working
directory is a temporary folder with the repository's `assets/` linked in: relative paths like
"assets/kimi-k3-tiny" resolve, and what the examples write lands in the temporary folder.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIREMENTS = {"gpu", "hub"}
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"#\s*needs:\s*([\w ,]+)")

RUNNER = r"""
import json, sys, traceback
namespace = {"__name__": "__main__"}
for name, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, name, "exec"), namespace)
    except BaseException:
        print(f"block {name} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def documents():
    paths = [os.path.join(ROOT, "README.md")]
    for folder in ("docs", "model_cards"):
        paths += sorted(os.path.join(ROOT, folder, n) for n in os.listdir(os.path.join(ROOT, folder))
                        if n.endswith(".md"))
    return paths


def blocks(path):
    """[(name "file:line", needs, code)] of the file's ```python blocks."""
    text = open(path, encoding="utf-8").read()
    out = []
    for m in BLOCK.finditer(text):
        code = m.group(1)
        first = code.split("\n", 1)[0]
        needs = NEEDS.match(first.strip())
        needs = {n.strip() for n in needs.group(1).split(",") if n.strip()} if needs else set()
        line = text.count("\n", 0, m.start(1)) + 1
        out.append((f"{os.path.relpath(path, ROOT)}:{line}", needs, code))
    return out


def available():
    return {"gpu"} if torch.cuda.is_available() else set()


DOCS = [p for p in documents() if blocks(p)]


def test_every_mark_names_a_known_requirement():
    for path in documents():
        for name, needs, _ in blocks(path):
            assert needs <= REQUIREMENTS, f"{name}: unknown requirement {needs - REQUIREMENTS}"


@pytest.mark.parametrize("path", DOCS, ids=[os.path.relpath(p, ROOT) for p in DOCS])
def test_python_blocks_run(path, tmp_path):
    runnable = [(name, code) for name, needs, code in blocks(path) if needs <= available()]
    if not runnable:
        pytest.skip("every block needs a GPU or the Hub")
    os.symlink(os.path.join(ROOT, "assets"), tmp_path / "assets")
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "src"), os.path.join(ROOT, "kernels"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
