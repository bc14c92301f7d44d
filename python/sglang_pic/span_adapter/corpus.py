"""Training text from what ships with the installed Python: the long descriptions of installed distributions (their
READMEs, from the package metadata), the docstrings of the standard library's modules and the source of its
documented functions (code passages, and tool descriptions made from their signatures), read with ast so that
nothing is imported, and the distributions' metadata fields as facts (version, licence, author...): records of one
shape whose values rival each other across packages, the case where span attention mixes up documents. No hub, no
network, and nothing of the span-quality suite's generators or vocabularies, so that suite stays a fair test of an
adapter trained on this.

The text differs from one machine to another with what is installed; its sha256 and source counts go into the
adapter's training record.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MIN_CHARS = 200  # shorter paragraphs join their neighbours: a passage should read as a document
_CODE_FENCE = re.compile(r"```.*?```", re.S)
_MARKUP = re.compile(r"!\[[^\]]*\]\([^)]*\)|<[^>]{1,200}>|\[!\[.*?\]\(.*?\)\]\(.*?\)")
_BLANKS = re.compile(r"\n\s*\n")
_LINES = re.compile(r".*?(?:\r\n|\r|\n)|.+", re.S)  # the line breaks ast counts (not str.splitlines' others)


@dataclass(frozen=True)
class Function:
    """A documented standard-library function: its source, and what a tool description of it says."""

    name: str
    params: tuple[str, ...]
    summary: str  # the docstring's first line
    source: str


@dataclass(frozen=True)
class Package:
    """An installed distribution's metadata fields as (label, value) facts; the labels are version, summary,
    license, author, python, dependencies and home page, those it states."""

    name: str
    facts: tuple[tuple[str, str], ...]


MIN_FACTS = 4  # a package with fewer reads as no record


@dataclass(frozen=True)
class Corpus:
    paragraphs: tuple[str, ...]
    functions: tuple[Function, ...]
    packages: tuple[Package, ...]
    sources: dict[str, int]  # source kind -> documents read
    sha256: str

    def record(self) -> dict:
        return {"paragraphs": len(self.paragraphs), "functions": len(self.functions), "packages": len(self.packages),
                "sources": self.sources, "sha256": self.sha256,
                "made_of": "installed distributions' long descriptions and metadata fields; the standard library's "
                           "docstrings and the source of its documented functions"}


def _paragraphs(text: str) -> list[str]:
    text = _MARKUP.sub("", _CODE_FENCE.sub("", text))
    out, run = [], ""
    for block in _BLANKS.split(text):
        block = " ".join(block.split())
        markup = block.startswith(("|", "===", "---", ".. "))
        if not block or markup or sum(c.isalpha() for c in block) < len(block) / 2:
            continue
        run = f"{run}\n{block}" if run else block
        if len(run) >= MIN_CHARS:
            out.append(run)
            run = ""
    return out


def _descriptions() -> list[str]:
    seen, out = set(), []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = (dist.metadata["Name"] or "").lower()
        body = dist.metadata.get_payload() or dist.metadata["Description"] or ""
        if name in seen or len(body) < MIN_CHARS:
            continue
        seen.add(name)
        out.append(body)
    return out


def _license(meta) -> str | None:
    text = meta["License-Expression"] or meta["License"] or ""
    if not text or len(text) > 40 or "\n" in text:
        classifiers = [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
        text = classifiers[0].rpartition(" :: ")[2] if classifiers else ""
    return text.strip() or None


def _author(meta) -> str | None:
    text = meta["Author"] or (meta["Author-email"] or "").partition("<")[0]
    return text.strip().strip('"') or None


def _packages() -> list[Package]:
    """Installed distributions that state at least MIN_FACTS facts, one per name."""
    seen, out = set(), []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        meta = dist.metadata
        name = meta["Name"] or ""
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        urls = [u.partition(",")[2].strip() for u in meta.get_all("Project-URL") or []]
        facts = {"version": meta["Version"], "summary": (meta["Summary"] or "").strip() or None,
                 "license": _license(meta), "author": _author(meta), "python": meta["Requires-Python"],
                 "dependencies": str(len(meta.get_all("Requires-Dist") or [])),
                 "home page": meta["Home-page"] or (urls[0] if urls else None)}
        kept = tuple((k, str(v)) for k, v in facts.items() if v)
        if len(kept) >= MIN_FACTS:
            out.append(Package(name, kept))
    return out


def _stdlib_modules() -> list[tuple[str, ast.Module]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/__init__.py")):
        try:
            text = path.read_text(encoding="utf-8")
            out.append((text, ast.parse(text)))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
    return out


def _docstrings(modules: list[tuple[str, ast.Module]]) -> list[str]:
    out = []
    for _, tree in modules:
        docs = [ast.get_docstring(tree) or ""]
        docs += [ast.get_docstring(node) or "" for node in tree.body
                 if isinstance(node, (ast.ClassDef, ast.FunctionDef))]
        text = "\n\n".join(d for d in docs if d)
        if len(text) >= MIN_CHARS:
            out.append(text)
    return out


def _functions(modules: list[tuple[str, ast.Module]]) -> list[Function]:
    """Public module-level functions with a docstring and a body of 4 to 60 lines."""
    out = []
    for text, tree in modules:
        lines = _LINES.findall(text)
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not doc or node.name.startswith("_") or not 4 <= node.end_lineno - node.lineno <= 60:
                continue
            params = tuple(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            out.append(Function(node.name, params, doc.strip().splitlines()[0], _source(lines, node)))
    return [f for f in out if f.source]


def _source(lines: list[str], node: ast.stmt) -> str:
    """What ast.get_source_segment gives for a node of several lines, from the module's lines split once: that
    function splits the whole module again on every call, which took seconds over the standard library."""
    first = lines[node.lineno - 1].encode()[node.col_offset:].decode()
    last = lines[node.end_lineno - 1].encode()[:node.end_col_offset].decode()
    return "".join([first, *lines[node.lineno:node.end_lineno - 1], last])


@functools.cache  # reading every installed distribution and stdlib module takes seconds; the set is fixed per process
def build_corpus() -> Corpus:
    modules = _stdlib_modules()
    descriptions, docstrings, functions = _descriptions(), _docstrings(modules), _functions(modules)
    packages = _packages()
    paragraphs = tuple(p for text in descriptions + docstrings for p in _paragraphs(text))
    facts = [f"{p.name}: {p.facts}" for p in packages]
    digest = hashlib.sha256("\n\0".join([*paragraphs, *(f.source for f in functions), *facts]).encode()).hexdigest()
    sources = {"distributions": len(descriptions), "stdlib_modules": len(docstrings),
               "stdlib_functions": len(functions), "package_metadata": len(packages)}
    return Corpus(paragraphs, tuple(functions), tuple(packages), sources, digest)
