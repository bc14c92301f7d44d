"""Print sglang_pic's package import graph from module-top imports, and every package cycle in it.

Only imports at a module's top level count (those inside functions or under `if TYPE_CHECKING:` run late or
never, so they cannot make an import cycle). A package here is `sglang_pic.<name>` for a subpackage and the
module itself for a top-level module. Exit status 1 when there is a cycle, so CI can run it.

--modules PREFIX... prints instead the module graph of the modules under those prefixes, with every module cycle.
There imports inside functions count too: deferred, they cannot fail at import time, but two modules that import
each other that way still depend on each other (an attention backend's base that imports the backends it picks
from). Imports under `if TYPE_CHECKING:` still do not count: they never run.

Usage: python scripts/import_graph.py [--dot] [--modules PREFIX [PREFIX ...]]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from package_tree import package_files



def modules() -> dict[str, Path]:
    out = {}
    for rel, path in package_files().items():
        parts = [p for p in rel.with_suffix("").parts if p != "__init__"]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(tree: ast.Module, deferred: bool) -> Iterator[ast.AST]:
    """The module's top-level statements; with `deferred`, every statement below them too (function bodies), except
    under `if TYPE_CHECKING:`."""
    if not deferred:
        yield from tree.body
        return
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not _is_type_checking(node):
            stack.extend(ast.iter_child_nodes(node))


def top_imports(path: Path, module: str, deferred: bool = False) -> set[str]:
    """Modules named by the file's top-level imports (absolute, or relative resolved against `module`); with
    `deferred`, by the imports inside its functions too."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in _import_nodes(tree, deferred):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        src = package_of(module)
        edges[src]
        for name in top_imports(path, module):
            if name in mods and package_of(name) != src and name != "sglang_pic":
                edges[src].add(package_of(name))
    return edges


def module_graph(prefixes: list[str]) -> dict[str, set[str]]:
    """Each module under `prefixes` -> the modules under them that it imports, at its top or inside functions."""
    mods = {m: p for m, p in modules().items() if any(m == x or m.startswith(f"{x}.") for x in prefixes)}
    return {m: {n for n in top_imports(path, m, deferred=True) if n in mods and n != m} for m, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dot", action="store_true", help="print the graph in Graphviz dot")
    p.add_argument("--modules", nargs="+", metavar="PREFIX",
                   help="the module graph under these prefixes (e.g. sglang_pic.layers), deferred imports included")
    args = p.parse_args()
    edges = module_graph(args.modules) if args.modules else graph()
    unit = "module" if args.modules else "package"
    short = {name: name.removeprefix("sglang_pic.") for name in edges}
    if args.dot:
        print("digraph imports {")
        for src in sorted(edges):
            for dst in sorted(edges[src]):
                print(f'  "{short[src]}" -> "{short.get(dst, dst)}";')
        print("}")
    else:
        width = max(22, *map(len, short.values()))
        for src in sorted(edges):
            print(f"{short[src]:<{width}} -> {', '.join(short.get(d, d) for d in sorted(edges[src])) or '-'}")
    found = cycles(edges)
    for comp in found:
        print(f"cycle: {', '.join(short.get(c, c) for c in comp)}")
    if not found:
        print(f"no {unit} cycle")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
