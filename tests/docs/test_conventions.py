"""Transformers conventions: labels -> loss, logits_to_keep, hidden states, router logits, dtype handling, init."""

import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kimi3_testing import ORACLE_A, needs_oracle, rel_err, tiny_k3_text_config, tiny_model
from transformers_kimi3 import Kimi3ForCausalLM


def test_labels_give_the_shifted_cross_entropy():
    model = tiny_model()
    ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(input_ids=ids, labels=labels)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 96).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, ref, atol=1e-6)


def test_logits_to_keep_hidden_states_and_router_logits():
    model = tiny_model()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    full = model(input_ids=ids, output_hidden_states=True, output_router_logits=True)
    last = model(input_ids=ids, logits_to_keep=1)
    assert last.logits.shape == (1, 1, 96) and torch.allclose(last.logits[:, 0], full.logits[:, -1], atol=1e-6)
    cfg = model.config
    assert len(full.hidden_states) == cfg.num_hidden_layers + 1
    n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    assert len(full.router_logits) == n_moe and full.router_logits[0].shape == (12, cfg.num_experts)


@needs_oracle
def test_bf16_load_keeps_fp32_modules_and_stays_close():
    o = load_file(os.path.join(ORACLE_A, "inputs_and_logits.safetensors"))
    model = Kimi3ForCausalLM.from_pretrained(ORACLE_A, dtype=torch.bfloat16)
    fp32 = {n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.dtype == torch.float32}
    for suffix in ("A_log", "dt_bias", "q_conv1d.weight", "o_norm.weight", "e_score_correction_bias"):
        assert any(n.endswith(suffix) for n in fp32), suffix
    assert model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        lg = model(input_ids=o["text_input_ids"][:1]).logits.float()
    ref = o["text_logits"][:1]
    # bf16 end to end through 8 random layers: a few percent, and the argmax mostly kept
    assert rel_err(lg, ref) < 0.2
    assert (lg.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_init_follows_fla_and_attnres_conventions():
    model = Kimi3ForCausalLM(tiny_k3_text_config())
    layer = model.model.layers[0]
    assert torch.count_nonzero(layer.self_attn.A_log) == 0  # bounded (safe) gate: A_log = 0
    dt = F.softplus(layer.self_attn.dt_bias)
    assert dt.min() >= 1e-4 * 0.999 and dt.max() <= 0.1 * 1.001
    assert torch.count_nonzero(layer.mlp_res_proj.weight) == 0  # uniform AttnRes mixing at the start
    assert torch.count_nonzero(model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias) == 0
    assert "Kimi3DecoderLayer" in model._no_split_modules


# ---------------------------------------------------------------------------------------------------------------
# Repository conventions: settings are config fields (at most three environment variables), code and docs state what
# is (no commit hashes, session narration or dated diaries), bench/ stays small, README.md stays short.

import ast  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HISTORY_FREE = ("src", "kernels", "conversion", "docs", "model_cards", "README.md")
MAX_ENV_NAMES, MAX_BENCH_SCRIPTS, MAX_BENCH_RESULTS, MAX_README_LINES = 3, 10, 16, 220


def _files(tops, exts):
    for top in tops:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield path
        for folder, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            yield from (os.path.join(folder, n) for n in sorted(names) if n.endswith(exts))


def _rel(path):
    return os.path.relpath(path, ROOT)


def _env_names(path):
    """The KIMI3_* names a module can read from the environment: every string constant that is exactly such a name
    (os.environ keys, module constants that hold one, helper arguments), except the `__all__` lists that export
    Python names; an f-string that builds a KIMI3_ name counts as a read of an unknown name."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    exported = {id(n) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                for n in ast.walk(node.value)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported:
            if re.fullmatch(r"KIMI3_[A-Z0-9_]+", node.value):
                names.add(node.value)
        elif isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.Constant) and "KIMI3_" in str(v.value)
                                                     for v in node.values):
            names.add(f"<an f-string at line {node.lineno}>")
    return names


def test_at_most_three_environment_variables_are_read():
    """What a user chooses is a config field; KIMI3_KDA_BACKEND and KIMI3_INFERENCE_KERNELS=0 are the environment
    variables (docs/kernels.md). A benchmark's knob is an explicit argument or context manager, not a variable."""
    readers, internals = {}, []
    for path in _files(("src", "kernels"), (".py",)):
        for name in _env_names(path):
            readers.setdefault(name, []).append(_rel(path))
        if "environ._data" in open(path, encoding="utf-8").read():
            internals.append(_rel(path))
    assert len(readers) <= MAX_ENV_NAMES, f"{len(readers)} KIMI3_* environment names: {readers}"
    assert not internals, f"modules reading os.environ's internals: {internals}"


# A commit hash: 7-40 hex digits standing alone (not part of a word, a number or a hex literal) with both a letter
# and a digit in it, or any such run that abbreviates a commit of this repository.
HASH = re.compile(r"(?<![\w#.\-])[0-9a-f]{7,40}(?![\w])")
NARRATION = re.compile(r"\b[Ss]essions?\b|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
                       r"eleventh|twelfth|[a-z]+teenth|twentieth|twenty-[a-z]+)\s+(?:session|round)\b|"
                       r"\b20\d\d-[01]\d-[0-3]\d\b")


def _commits():
    try:
        out = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def test_no_history_in_code_and_docs():
    """Code, docs and model cards state what is and why; git log and bench/results keep how it got there: no commit
    hashes, no session or round narration, no dated diary entries."""
    commits = _commits()
    found = []
    for path in _files(HISTORY_FREE, (".py", ".md")):
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            hashes = [h for h in HASH.findall(line) if (re.search("[a-f]", h) and re.search("[0-9]", h))
                      or any(c.startswith(h) for c in commits)]
            marks = hashes + [m.group(0) for m in NARRATION.finditer(line)]
            if marks:
                found.append(f"{_rel(path)}:{n}: {', '.join(marks)}")
    assert not found, f"{len(found)} history marks:\n" + "\n".join(found[:60])


def test_paths_named_in_docs_exist():
    """Every repository file a document names (tests, bench scripts, examples, docs) is where it says; Transformers'
    own test files, which docs/transformers_compat.md names, are not ours."""
    theirs = {"tests/test_modeling_common.py", "tests/test_configuration_common.py", "tests/causal_lm_tester.py"}
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md")] + [
        os.path.join(ROOT, d, n) for d in ("docs", "model_cards") for n in sorted(os.listdir(os.path.join(ROOT, d)))
        if n.endswith(".md")]
    missing = []
    for path in docs:
        text = open(path, encoding="utf-8").read()
        for name in sorted(set(re.findall(r"\b(?:tests|bench|examples|docs)/[\w/]+\.(?:py|md)\b", text)) - theirs):
            if not os.path.isfile(os.path.join(ROOT, name)):
                missing.append(f"{_rel(path)}: {name}")
    assert not missing, "\n".join(missing)


def _anchors(path):
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_between_documents_resolve():
    """Every relative Markdown link of the README, docs and model cards reaches a file, and its #anchor a heading."""
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md")] + [
        os.path.join(ROOT, d, n) for d in ("docs", "model_cards") for n in sorted(os.listdir(os.path.join(ROOT, d)))
        if n.endswith(".md")]
    broken = []
    for path in docs:
        text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue
            file, _, anchor = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(target):
                broken.append(f"{_rel(path)}: {link} (no such file)")
            elif anchor and target.endswith(".md") and anchor not in _anchors(target):
                broken.append(f"{_rel(path)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_bench_stays_small():
    bench = os.path.join(ROOT, "bench")
    scripts = sorted(n for n in os.listdir(bench) if n.endswith((".py", ".sh")))
    assert len(scripts) <= MAX_BENCH_SCRIPTS, scripts
    results = sorted(os.listdir(os.path.join(bench, "results")))
    assert len(results) <= MAX_BENCH_RESULTS, results


def test_readme_reads_in_five_minutes():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= MAX_README_LINES, len(lines)


def _module_imports(package_dir, package):
    """module -> the modules of `package` it imports, at the top or inside functions (lazy imports count too)."""
    names = {os.path.relpath(p, package_dir)[:-3].replace(os.sep, ".").removesuffix(".__init__")
             for p in _files((os.path.relpath(package_dir, ROOT),), (".py",))}
    graph = {}
    for name in names:
        path = os.path.join(package_dir, *name.split(".")) + ".py"
        if not os.path.isfile(path):
            path = os.path.join(package_dir, *name.split("."), "__init__.py")
        is_pkg = path.endswith("__init__.py")
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                    mod = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.split(".")[0] == package:
                    mod = node.module.partition(".")[2]
                else:
                    continue
                # `from pkg import sub` imports the submodule pkg.sub; `from mod import name` the module mod
                subs = [f"{mod}.{a.name}" if mod else a.name for a in node.names]
                targets = [t if t in names else mod for t in subs]
            elif isinstance(node, ast.Import):
                targets = [a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == package]
            deps.update(t for t in targets if t in names and t != name)
        graph[name] = deps
    return graph


@pytest.mark.parametrize("package_dir,package", [("src/transformers_kimi3", "transformers_kimi3"),
                                                 ("kernels/kimi3_kernels", "kimi3_kernels")])
def test_no_import_cycles(package_dir, package):
    """No two modules of a package import each other, directly or through others, lazy imports included: each concept
    has one home and a reader can follow the imports one way."""
    graph = _module_imports(os.path.join(ROOT, package_dir), package)
    state = {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                raise AssertionError(f"{package}: import cycle {' -> '.join(path[path.index(dep):] + [dep])}")
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert len(graph) > 5, sorted(graph)  # the walk saw the package's modules
