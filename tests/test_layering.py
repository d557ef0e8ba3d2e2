"""The package's layering, read from the source (module-level imports only; imports inside functions are the lazy
loads of optional pieces): imports point down the layers, no import cycle, and the fast path does not import the
reference backend or the oracles."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mxcomm"

# layer of each subpackage: a module may import from its own layer or a lower one
LAYERS = {"mx": 0, "kernels": 1, "transport": 1, "ep": 2, "gemm": 3, "nn": 4, "bench": 5, "cli": 5,
          "integrations": 5, "__main__": 6}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level_imports(path: Path) -> set[str]:
    """Absolute names of the mxcomm modules ``path`` imports at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in tree.body:
        nodes = [node]
        if isinstance(node, (ast.If, ast.Try)):  # e.g. guarded optional imports
            nodes = list(ast.walk(node))
        for n in nodes:
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (n.level - 1)]
                    target = ".".join(base + ([n.module] if n.module else []))
                else:
                    target = n.module or ""
                if target.startswith("mxcomm"):
                    out.add(target)
                    for a in n.names:  # "from . import plan" imports the module mxcomm.ep.plan
                        sub = f"{target}.{a.name}"
                        if (PKG.parent / Path(*sub.split("."))).with_suffix(".py").exists():
                            out.add(sub)
            elif isinstance(n, ast.Import):
                out.update(a.name for a in n.names if a.name.startswith("mxcomm"))
    return out


def _modules() -> dict[str, set[str]]:
    return {_module_name(p): _top_level_imports(p) for p in PKG.rglob("*.py")}


def _layer(mod: str):
    parts = mod.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_imports_point_down_the_layers():
    bad = []
    for mod, deps in _modules().items():
        lm = _layer(mod)
        if lm is None:
            continue
        for d in deps:
            ld = _layer(d)
            if ld is not None and ld > lm:
                bad.append(f"{mod} (layer {lm}) imports {d} (layer {ld})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _modules()
    names = set(graph)

    def resolve(d: str) -> str:
        while d and d not in names:
            d = d.rsplit(".", 1)[0] if "." in d else ""
        return d

    edges = {m: {resolve(d) for d in deps} - {"", m} for m, deps in graph.items()}
    # a package's __init__ importing its own submodules is not a cycle through the submodule's "from . import"
    state, cycle = {}, []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if d.startswith(m + ".") or m.startswith(d + ".") and d in ("mxcomm",):
                continue
            if state.get(d) == 1:
                cycle.append(stack[stack.index(d):] + [d])
            elif state.get(d) is None:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if state.get(m) is None:
            visit(m, [])
    assert not cycle, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycle[:10])


# the fast path: every module of the GPU backend (the subpackage mxcomm.ep.nvshmem) and the public API's modules it
# runs under
FAST_PATH = sorted(m for m in _modules() if m == "mxcomm.ep.nvshmem" or m.startswith("mxcomm.ep.nvshmem.")) + [
    "mxcomm.ep.steps", "mxcomm.ep.functions", "mxcomm.ep.compiled", "mxcomm.ep.group"]


@pytest.mark.parametrize("fast", FAST_PATH)
def test_fast_path_does_not_import_the_reference(fast):
    deps = _modules()[fast]
    assert not [d for d in deps if d.startswith("mxcomm.ep.reference")], deps


def test_the_checker_sees_imports():
    """The parser finds this package's real imports (a checker that sees nothing would pass everything)."""
    mods = _modules()
    assert "mxcomm.ep.plan" in mods["mxcomm.ep.nvshmem.backend"]
    assert "mxcomm.mx" in mods["mxcomm.ep.handle"]
    assert "mxcomm.ep.collectives" in mods["mxcomm.ep.reference.backend"]
    # the fast path's list holds the GPU backend's modules, its subpackages' included
    assert {"mxcomm.ep.nvshmem.backend", "mxcomm.ep.nvshmem.paths.put", "mxcomm.ep.nvshmem.kernels.combine",
            "mxcomm.ep.nvshmem.plan_kernels", "mxcomm.ep.nvshmem.status_words"} <= set(FAST_PATH)
