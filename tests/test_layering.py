"""The package's architecture, read from its AST: every import points down the layers, none forms a cycle, no
private name crosses a module boundary, and outside `compat` only its public engine packages are imported.

Imports inside functions count (they run too); imports under `if TYPE_CHECKING:` do not (they never run).
CONTRIBUTING.md ("Where a change goes") draws the same layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "lorafast"

#: Layer of each top-level module or package of lorafast, lowest first. A module may import its own layer or
#: a lower one, never a higher one.
LAYERS: dict[str, int] = {
    # 1. the base vocabulary
    "_core": 1,
    "_records": 1,
    "errors": 1,
    "codes": 1,
    "formats": 1,
    # 2. the model
    "adapter": 2,
    "header": 2,
    "tensors": 2,
    "naming": 2,
    "scanning": 2,
    "base": 2,
    "families": 2,
    "testing": 2,
    "sample": 2,
    "sample_bases": 2,
    # 3. engines and features
    "compat": 3,
    "planner": 3,
    "groups": 3,
    "merging": 3,
    "converting": 3,
    "checker": 3,
    "serving": 3,
    # 4. applications
    "cli": 4,
    "demo": 4,
    "__main__": 4,
}

#: What code outside `compat` may import of it: the package and its public engine modules.
COMPAT_PUBLIC = frozenset(
    {"lorafast.compat", "lorafast.compat.sglang", "lorafast.compat.vllm", "lorafast.compat.diffusion",
     "lorafast.compat.launch"}
)  # fmt: skip


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the module imported, dotted (a name imported from a package resolves to its submodule)
    name: str | None  # the name imported from `target` (`from target import name`), None for a module
    line: int


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _known(target: str) -> str:
    while target not in MODULES and "." in target and target != "lorafast._core":
        target = target.rsplit(".", 1)[0]
    return target


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import nodes anywhere in the module, except under `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def _imports() -> list[Import]:
    out = []
    for module, (path, is_package) in MODULES.items():
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                out.extend(
                    Import(module, _known(a.name), None, node.lineno)
                    for a in node.names
                    if a.name.split(".")[0] == "lorafast"
                )
                continue
            target = _resolve(module, is_package, node.level, node.module)
            if target.split(".")[0] != "lorafast":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES or sub == "lorafast._core":
                    out.append(Import(module, sub, None, node.lineno))
                else:
                    out.append(Import(module, _known(target), alias.name, node.lineno))
    return out


IMPORTS = _imports()


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _where(i: Import) -> str:
    return f"{MODULES[i.module][0].relative_to(PACKAGE.parent)}:{i.line}"


def test_every_module_has_a_layer() -> None:
    missing = sorted({m.split(".")[1] for m in MODULES if m != "lorafast" and _layer(m) is None})
    assert not missing, f"add these to LAYERS (and CONTRIBUTING.md's layer map): {missing}"


def test_imports_point_down() -> None:
    up = [
        f"{_where(i)}: {i.module} (layer {_layer(i.module)}) imports {i.target} (layer {_layer(i.target)})"
        for i in IMPORTS
        if i.module != "lorafast" and (_layer(i.target) or 0) > (_layer(i.module) or 0)
    ]
    assert not up, "imports that point up:\n" + "\n".join(up)


def test_the_package_root_imports_only_the_base_vocabulary() -> None:
    # `import lorafast` stays cheap: everything else loads on first use of a name (`_LAZY`)
    eager = [f"{_where(i)}: {i.target}" for i in IMPORTS if i.module == "lorafast" and _layer(i.target) != 1]
    assert not eager, eager


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    # the package root imports its submodules only lazily (by name, through importlib): it is no node here
    edges = {(i.module, i.target) for i in IMPORTS if i.module != i.target and "lorafast" not in (i.module, i.target)}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert _cycles({("a", "b"), ("b", "c")}) == []


def test_no_private_name_crosses_a_module_boundary() -> None:
    crossing = [
        f"{_where(i)}: {i.module} imports {i.name} from {i.target}"
        for i in IMPORTS
        if i.name is not None and i.name.startswith("_") and not i.name.startswith("__") and i.target != i.module
    ]
    assert not crossing, "give these a public name (in a private module where they are not API):\n" + "\n".join(
        crossing
    )


def test_outside_compat_only_its_public_engine_packages_are_imported() -> None:
    inside = [
        f"{_where(i)}: {i.target}"
        for i in IMPORTS
        if i.target.startswith("lorafast.compat")
        and not i.module.startswith("lorafast.compat")
        and i.target not in COMPAT_PUBLIC
    ]
    assert not inside, inside


def test_library_code_never_imports_the_cli() -> None:
    to_cli = [
        f"{_where(i)}: {i.module}"
        for i in IMPORTS
        if i.target.startswith("lorafast.cli") and (_layer(i.module) or 0) < LAYERS["cli"]
    ]
    assert not to_cli, to_cli


@pytest.mark.parametrize("package", ["formats", "cli", "compat"])
def test_packages_named_by_the_layout_exist(package: str) -> None:
    assert (PACKAGE / package / "__init__.py").is_file()
