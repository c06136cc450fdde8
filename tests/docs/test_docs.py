"""Every Python block of README.md, docs/*.md and model_cards/*.md runs, on the CPU and without the network.

Convention: a ```python block whose first line is `# needs: gpu`, `# needs: hub` or `# needs: gpu, hub` needs a CUDA
GPU or the Hugging Face Hub, and is skipped here (a `gpu`-only block runs where CUDA is available); every other
block must run. The blocks of one file run in order in one namespace, so a later block may use what an earlier one
defined (and must carry the marks of any marked block it depends on). Each file runs in a process of its own whose
working directory is a temporary folder with the repository's `assets/` linked in: relative paths like
"assets/kimi-k3-tiny" resolve, and what the examples write lands in the temporary folder.

Without CUDA (CI) those processes are forked from one that has imported what every document imports (torch,
Transformers, transformers_kimi3: ~5 s of an interpreter's start, paid once instead of once per file): each document
still gets a new process, a fresh namespace, its own working directory and the same environment, and nothing one
document does reaches another. A fork cannot carry CUDA over, so with CUDA (the GPU suite) each document starts its
own interpreter.
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

# Reads a document's folder (holding blocks.json) per line of stdin, runs RUNNER on it in a forked child whose
# stdout and stderr go to stdout.txt / stderr.txt there, and answers with the child's exit status as an interpreter
# would end (negative: the signal that ended it, SIGALRM at 900 s, a document's time limit).
FORK_SERVER = r"""
import atexit, os, signal, sys, traceback
import torch, transformers, transformers_kimi3  # noqa: F401
RUNNER = sys.argv[1]
for line in sys.stdin:
    folder = line.strip()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(900)
            os.chdir(folder)
            for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
                os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.argv = ["-c", os.path.join(folder, "blocks.json")]
            try:
                exec(compile(RUNNER, "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:  # as an interpreter ends on it
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            atexit._run_exitfuncs()  # what an interpreter runs at its end
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
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


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "src"), os.path.join(ROOT, "kernels"), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    """The process the documents' processes are forked from (None with CUDA: each starts its own interpreter)."""
    if "gpu" in available():
        yield None
        return
    log = tmp_path_factory.mktemp("fork_server") / "stderr.txt"
    with open(log, "w") as err:
        server = subprocess.Popen([sys.executable, "-c", FORK_SERVER, RUNNER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, text=True, env=_env(), cwd=log.parent)
    yield server, log
    server.stdin.close()
    server.kill()  # every document's process has ended; no need to wait for its interpreter to tear itself down
    server.wait(timeout=60)


@pytest.mark.parametrize("path", DOCS, ids=[os.path.relpath(p, ROOT) for p in DOCS])
def test_python_blocks_run(path, tmp_path, fork_server):
    runnable = [(name, code) for name, needs, code in blocks(path) if needs <= available()]
    if not runnable:
        pytest.skip("every block needs a GPU or the Hub")
    os.symlink(os.path.join(ROOT, "assets"), tmp_path / "assets")
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    if fork_server is None:
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return
    server, log = fork_server
    server.stdin.write(f"{tmp_path}\n")
    server.stdin.flush()
    status = server.stdout.readline().strip()
    assert status, f"the fork server stopped:\n{log.read_text()[-4000:]}"
    stderr = (tmp_path / "stderr.txt").read_text() if (tmp_path / "stderr.txt").exists() else ""
    assert int(status) == 0, stderr[-4000:]
