"""The text corpus of kimi-k3-mini: openly licensed English documentation, rebuilt from package registries.

Sources (each document keeps its source name; nothing of the text is committed, this module rebuilds it):

- `python-docs`: Debian's `python3.11-doc`, the reStructuredText sources of the Python 3.11 documentation
  (`usr/share/doc/python3.11/html/_sources/**.rst.txt`); PSF License Agreement.
- `django-docs`: Debian's `python-django-doc`, the Django 3.2 documentation as HTML; BSD-3-Clause (Django Software
  Foundation).
- `postgresql-docs`: Debian's `postgresql-doc-15`, the PostgreSQL 15 manual as HTML; PostgreSQL License (permissive,
  BSD-like; PostgreSQL Global Development Group).
- `sqlite-docs`: Debian's `sqlite3-doc`, the SQLite 3.40 documentation as HTML; public domain (D. Richard Hipp).
- `sqlalchemy-docs`: Debian's `python-sqlalchemy-doc`, the SQLAlchemy 1.4 documentation as HTML; MIT (Expat; the
  SQLAlchemy authors).
- `stdlib-docstrings`: the docstrings of the running Python's standard library (`sysconfig.get_paths()["stdlib"]`),
  read with `ast`, nothing imported; PSF License Agreement.

Extraction keeps prose: reStructuredText directives that only hold code, tables of contents, index entries or
includes are dropped with their bodies; code blocks (`::` literal blocks, doctests) are dropped; admonitions
(note, warning, versionchanged...) and API descriptions (`.. function:: name(args)`) keep their text; inline roles
become their text (``:func:`~json.dumps` `` -> `dumps`). HTML pages (Sphinx, DocBook, SQLite's) keep the text of
paragraphs, lists, headings and definition lists, never `<pre>` blocks, navigation or scripts. Paragraphs with too
few words or letters are dropped.
Documents are page sections (reStructuredText / HTML) or one module's docstrings, each with its title; a paragraph
that appears again anywhere in the corpus is kept once.
"""

import ast
import glob
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sysconfig
import textwrap

# source -> Debian package, the folder inside it, the format, the pages left out (prefixes) and the license
PACKAGES = {
    "python-docs": dict(package="python3.11-doc", folder="usr/share/doc/python3.11/html/_sources", format="rst",
                        skip=("whatsnew/changelog", "includes/"), license="PSF-2.0"),
    "django-docs": dict(package="python-django-doc", folder="usr/share/doc/python-django-doc/html", format="html",
                        skip=("_", "genindex", "py-modindex", "search"), license="BSD-3-Clause"),
    "postgresql-docs": dict(package="postgresql-doc-15", folder="usr/share/doc/postgresql-doc-15/html", format="html",
                            skip=("bookindex", "index"), license="PostgreSQL"),
    # c3ref/ splits capi3ref.html into one page per interface
    "sqlite-docs": dict(package="sqlite3-doc", folder="usr/share/doc/sqlite3", format="html",
                        skip=("chronology", "doclist", "sitemap", "keyword_index", "toc", "c3ref/"),
                        license="public-domain"),
    "sqlalchemy-docs": dict(package="python-sqlalchemy-doc", folder="usr/share/doc/python-sqlalchemy-doc/html",
                            format="html", skip=("_", "genindex", "search", "py-modindex"), license="MIT"),
}
LICENSES = {**{name: spec["license"] for name, spec in PACKAGES.items()}, "stdlib-docstrings": "PSF-2.0"}
SOURCES = (*PACKAGES, "stdlib-docstrings")
EVAL_FRACTION = 0.02

# ----------------------------------------------------------------------------- reStructuredText
# directives whose body is prose (kept, dedented); every other directive is dropped with its body
_PROSE_DIRECTIVES = {"note", "warning", "tip", "important", "attention", "caution", "danger", "hint", "seealso",
                     "admonition", "impl-detail", "versionadded", "versionchanged", "deprecated", "deprecated-removed",
                     "describe", "function", "method", "class", "attribute", "data", "exception", "decorator",
                     "classmethod", "staticmethod", "decoratormethod", "opcode", "cmdoption", "option", "envvar",
                     "glossary", "rubric", "topic", "sidebar", "container", "only", "c:function", "c:type",
                     "c:member", "c:macro", "c:var", "abstractmethod", "coroutinefunction", "coroutinemethod",
                     "awaitablefunction", "pdbcommand", "index-free"}
_SIGNATURE_DIRECTIVES = {"function", "method", "class", "attribute", "data", "exception", "decorator", "classmethod",
                         "staticmethod", "decoratormethod", "abstractmethod", "coroutinefunction", "coroutinemethod",
                         "awaitablefunction", "c:function", "c:type", "c:member", "c:macro", "c:var", "describe"}
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_UNDERLINE = re.compile(r"^([=\-~^*#\"'`+.:_])\1{2,}\s*$")
_TABLE_RULE = re.compile(r"^\s*[+=][-=+ ]{3,}\s*$")
_ROLE = re.compile(r":[\w:.-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`__?")
_REF = re.compile(r"`([^`]+)`__?")
_LITERAL = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"(?<![\w*])\*\*?([^*\s][^*]*?)\*\*?(?![\w*])")
_FOOTNOTE = re.compile(r"\s*\[(?:#[\w-]*|\d+|\*)\]_")


def _role_text(match):
    text = match.group(1)
    target = re.match(r"^(.*?)\s*<[^>]*>$", text)
    if target and target.group(1):
        return target.group(1)
    text = text.lstrip("!")
    return text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text


def rst_inline(text):
    """Inline reStructuredText markup -> plain text."""
    text = _ROLE.sub(_role_text, text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _REF.sub(r"\1", text)
    text = _FOOTNOTE.sub("", text)
    text = _EMPH.sub(r"\1", text)
    return text.replace("\\ ", "").replace("|version|", "3.11").replace("|release|", "3.11")


def _indent(line):
    return len(line) - len(line.lstrip())


def _skip_block(lines, i, base):
    """Index of the first line after the block indented deeper than `base` that starts at `i`."""
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
        i += 1
    return i


def rst_to_sections(source):
    """[(title, [paragraph, ...])] of one reStructuredText file, prose only."""
    lines = source.expandtabs(8).splitlines()
    sections, title, paragraphs, buf = [], "", [], []

    def flush():
        if buf:
            paragraphs.append(rst_inline(" ".join(s.strip() for s in buf)))
            buf.clear()

    i = 0
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if _UNDERLINE.match(stripped) and not buf:
            i += 1  # an overline or a transition
            continue
        if stripped and _UNDERLINE.match(nxt.strip()) and len(nxt.strip()) >= len(stripped) * 0.6 and not buf:
            if paragraphs:
                sections.append((title, paragraphs))
            title, paragraphs = rst_inline(stripped), []
            i += 2
            continue
        directive = _DIRECTIVE.match(line)
        if directive:
            flush()
            base, name, arg = _indent(line), directive.group(2), directive.group(3)
            if name not in _PROSE_DIRECTIVES:
                i = _skip_block(lines, i + 1, base)
                continue
            if name in _SIGNATURE_DIRECTIVES and arg:
                paragraphs.append(rst_inline(arg))
            elif arg and name not in ("only", "container", "glossary", "index-free"):
                buf.append(arg)
            i += 1
            while i < len(lines) and re.match(r"^\s+:[\w-]+:", lines[i]):
                i += 1  # directive options
            continue
        if stripped.startswith(".."):  # comments, link targets, substitutions
            i = _skip_block(lines, i + 1, _indent(line))
            continue
        if stripped.startswith((">>>", "$ ", "% ")) or _TABLE_RULE.match(line):
            flush()
            i = _skip_block(lines, i + 1, _indent(line) - 1) if stripped.startswith(">>>") else i + 1
            continue
        if not stripped:
            flush()
            i += 1
            continue
        if stripped.endswith("::"):
            text = stripped[:-2].rstrip()
            if text:
                buf.append(text + ":")
            flush()
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            i = _skip_block(lines, j, _indent(line)) if j < len(lines) and _indent(lines[j]) > _indent(line) else j
            continue
        if stripped.startswith(("- ", "* ", "#. ")) or re.match(r"^\d+\.\s", stripped):
            flush()
        buf.append(stripped.strip("|").strip())
        i += 1
    flush()
    if paragraphs:
        sections.append((title, paragraphs))
    return sections


# ----------------------------------------------------------------------------- HTML (Sphinx and DocBook pages)
class _PageText(html.parser.HTMLParser):
    """Paragraph text of a Sphinx, DocBook or SQLite HTML page from its body on (the first body container or
    heading), split at its h1/h2 headings."""

    BLOCKS = {"p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "td", "th", "blockquote", "div", "br", "tr"}
    SKIP = {"pre", "script", "style", "nav", "head", "form", "button", "select", "svg"}
    SKIP_CLASSES = ("headerlink", "highlight", "sphinxsidebar", "related", "footer", "nav", "toctree", "breadcrumbs",
                    "admonition-title", "rubric", "toc", "synopsis", "programlisting", "screen", "indexterm", "menu",
                    "viewcode", "tagline", "codeblock")
    BODY_CLASSES = {"section", "sect1", "chapter", "refentry", "appendix", "preface", "part", "sect2", "reference",
                    "fancy"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections, self.title, self.paragraphs, self.buf = [], "", [], []
        self.skip_depth, self.stack, self.in_body, self.heading = 0, [], False, None

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "hr", "meta", "link", "input"):
            return
        attrs = dict(attrs)
        cls = attrs.get("class") or ""
        skip = tag in self.SKIP or any(c in cls for c in self.SKIP_CLASSES)
        self.stack.append((tag, skip))
        self.skip_depth += skip
        if tag == "div" and (self.BODY_CLASSES & set(cls.split()) or attrs.get("role") == "main"):
            self.in_body = True
        if tag in self.BLOCKS:
            self._flush()
        if tag in ("h1", "h2"):
            self.in_body, self.heading = True, []

    def handle_endtag(self, tag):
        if not any(t == tag for t, _ in self.stack):
            return
        while self.stack:
            t, skip = self.stack.pop()
            self.skip_depth -= skip
            if t == tag:
                break
        if tag in ("h1", "h2") and self.heading is not None:
            self._flush(drop=True)
            if self.paragraphs:
                self.sections.append((self.title, self.paragraphs))
            self.title, self.paragraphs, self.heading = " ".join("".join(self.heading).split()), [], None
        elif tag in self.BLOCKS:
            self._flush()

    def handle_data(self, data):
        if self.skip_depth or not self.in_body:
            return
        (self.heading if self.heading is not None else self.buf).append(data)

    def _flush(self, drop=False):
        text = " ".join("".join(self.buf).split())
        self.buf = []
        if text and not drop:
            self.paragraphs.append(text)

    def close(self):
        super().close()
        self._flush()
        if self.paragraphs:
            self.sections.append((self.title, self.paragraphs))
        return self.sections


def html_to_sections(source):
    parser = _PageText()
    parser.feed(source)
    return parser.close()


# ----------------------------------------------------------------------------- docstrings
def _signature(node):
    try:
        return f"{node.name}({ast.unparse(node.args)})"
    except (AttributeError, ValueError):
        return node.name


def module_docstrings(path, module):
    """(document text, [record]) of one stdlib module: its docstrings in source order, each under its name.
    A record is {"name", "signature", "kind", "doc"} for each public function, class and method."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return "", []
    parts, records = [], []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"Module {module}\n\n{doc}")

    def visit(body, prefix):
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            name = f"{prefix}.{node.name}"
            sig = node.name if isinstance(node, ast.ClassDef) else _signature(node)
            doc = ast.get_docstring(node)
            if doc:
                parts.append(f"{prefix}.{sig}\n\n{doc}")
                kind = "class" if isinstance(node, ast.ClassDef) else ("method" if prefix != module else "function")
                records.append({"name": name, "signature": f"{prefix}.{sig}", "kind": kind, "doc": doc})
            if isinstance(node, ast.ClassDef):
                visit(node.body, name)

    visit(tree.body, module)
    return "\n\n".join(parts), records


def stdlib_documents(stdlib=None, modules=None):
    """Documents and records of the standard library's docstrings (tests, site-packages, idlelib, lib2to3 and
    private modules left out); `modules` (dotted names) reads only those."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    if modules is not None:
        paths = [os.path.join(stdlib, *m.split(".")) for m in modules]
        files = [p + ".py" if os.path.isfile(p + ".py") else os.path.join(p, "__init__.py") for p in paths]
    else:
        files = _stdlib_files(stdlib)
    docs, records = [], []
    for path in files:
        rel = os.path.relpath(path, stdlib)[:-3].replace(os.sep, ".")
        module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
        text, recs = module_docstrings(path, module)
        if text:
            docs.append({"id": f"stdlib:{module}", "source": "stdlib-docstrings", "title": module, "text": text})
            records += recs
    return docs, records


def _stdlib_files(stdlib):
    skip = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__", "idlelib", "lib2to3",
            "turtledemo", "ensurepip"}
    out = []
    for folder, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("config-"))
        out += [os.path.join(folder, n) for n in sorted(files)
                if n.endswith(".py") and (not n.startswith("_") or n == "__init__.py")]
    return out


# ----------------------------------------------------------------------------- cleaning, sources, the build
def clean_paragraph(text):
    text = " ".join(text.split())
    letters = sum(c.isalpha() for c in text)
    if len(text.split()) < 3 or letters < 0.6 * len(text.replace(" ", "")):
        return None
    return text


def section_documents(sections, doc_id, source):
    out = []
    for k, (title, paragraphs) in enumerate(sections):
        kept = [p for p in (clean_paragraph(p) for p in paragraphs) if p]
        if kept and sum(len(p) for p in kept) >= 200:
            text = (f"{title}\n\n" if title else "") + "\n\n".join(textwrap.fill(p, 10**9) for p in kept)
            out.append({"id": f"{doc_id}#{k}", "source": source, "title": title, "text": text})
    return out


def fetch_debian_package(package, into):
    """Download (`apt-get download`) and unpack (`dpkg-deb -x`) a Debian package; returns the unpack folder."""
    os.makedirs(into, exist_ok=True)
    unpacked = os.path.join(into, package)
    if os.path.isdir(unpacked):
        return unpacked
    debs = glob.glob(os.path.join(into, f"{package}_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", package], cwd=into, check=True, capture_output=True)
        debs = glob.glob(os.path.join(into, f"{package}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", sorted(debs)[-1], unpacked + ".tmp"], check=True)
    os.replace(unpacked + ".tmp", unpacked)
    return unpacked


def package_documents(source, root):
    """Documents of one Debian documentation package unpacked at `root` (see `PACKAGES`)."""
    spec = PACKAGES[source]
    base = os.path.join(root, spec["folder"])
    pattern = "**/*.rst.txt" if spec["format"] == "rst" else "**/*.html"
    docs = []
    for path in sorted(glob.glob(os.path.join(base, pattern), recursive=True)):
        rel = os.path.relpath(path, base).removesuffix(".rst.txt").removesuffix(".html")
        if rel.startswith(spec["skip"]):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        sections = rst_to_sections(text) if spec["format"] == "rst" else html_to_sections(text)
        docs += section_documents(sections, f"{source}:{rel}", source)
    return docs


def drop_repeats(docs, min_chars=80):
    """Each paragraph of `min_chars` or more kept once over the whole corpus (the first time it appears); a document
    left with less than 200 characters of text is dropped."""
    seen, out = set(), []
    for doc in docs:
        paragraphs = doc["text"].split("\n\n")
        head, kept = paragraphs[:1] if doc["title"] else [], []
        for p in paragraphs[len(head):]:
            key = hashlib.sha1(p.encode()).digest()
            if len(p) >= min_chars and key in seen:
                continue
            seen.add(key)
            kept.append(p)
        if sum(map(len, kept)) >= 200:
            out.append({**doc, "text": "\n\n".join(head + kept)})
    return out


def is_eval(doc_id, fraction=EVAL_FRACTION):
    """The held-out split, by a hash of the document id: stable whatever the order or the other documents."""
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) < fraction * 2**32


def build_corpus(out_dir, sources=SOURCES, packages_dir=None, stdlib_modules=None):
    """Write `corpus.jsonl` (one document a line, each with its split) and `records.jsonl` (the stdlib API records
    the chat data asks about) into `out_dir`. Returns a summary dict (documents, characters per source and split).
    `stdlib_modules` limits the docstrings to those modules."""
    os.makedirs(out_dir, exist_ok=True)
    packages_dir = packages_dir or os.path.join(out_dir, "packages")
    docs, records = [], []
    for source in sources:
        if source == "stdlib-docstrings":
            stdlib_docs, records = stdlib_documents(modules=stdlib_modules)
            docs += stdlib_docs
        else:
            docs += package_documents(source, fetch_debian_package(PACKAGES[source]["package"], packages_dir))
    return write_corpus(out_dir, drop_repeats(docs), records)


def write_corpus(out_dir, docs, records):
    summary = {}
    with open(os.path.join(out_dir, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for doc in docs:
            doc["split"] = "eval" if is_eval(doc["id"]) else "train"
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            entry = summary.setdefault(f"{doc['source']}/{doc['split']}", {"documents": 0, "characters": 0})
            entry["documents"] += 1
            entry["characters"] += len(doc["text"])
    with open(os.path.join(out_dir, "records.jsonl"), "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    summary["licenses"] = {s: LICENSES[s] for s in sorted({d["source"] for d in docs})}
    summary["records"] = len(records)
    with open(os.path.join(out_dir, "corpus_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
