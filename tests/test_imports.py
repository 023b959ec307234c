"""autosp's modules import down the stack only, and no module imports itself back through
others: annotations -> backend -> partition -> propagate -> the leaves (_graph, _attention_ops,
_lengths, _context, _devices, _repeats, errors). Read from the source (every import statement,
function-level ones included), so a lazy import that dodges a cycle at run time is caught too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autosp"
# bottom to top; a module may import its own layer and the ones below
LAYERS = [
    (
        "autosp._graph",
        "autosp._attention_ops",
        "autosp._lengths",
        "autosp._context",
        "autosp._devices",
        "autosp._repeats",
        "autosp.errors",
    ),
    ("autosp.propagate",),
    ("autosp.partition",),
    ("autosp.backend",),
    ("autosp.annotations",),
    ("autosp", "autosp._cli", "autosp.__main__"),
    ("autosp.integrations",),  # on top: frameworks' adapters over the public API
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, module
    return level


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The autosp modules ``module`` imports (a name imported from a package counts as the
    submodule it names, else as the package)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node) for n in ast.walk(node)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "autosp"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "autosp":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    return {m for m in out if m != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_imports_point_down_the_stack():
    """Catches a rule reaching up into the partitioner for a cost model, errors importing the
    rules, the backend importing the user-facing annotations."""
    upward = sorted((m, t) for m, targets in _graph().items() for t in targets if _layer(t) > _layer(m))
    assert not upward, "imports up the stack (module, imported):\n" + "\n".join(f"  {m} -> {t}" for m, t in upward)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state and (cycle := visit(t)) is not None:
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_import_autosp_imports_no_training_framework():
    """``autosp.integrations.transformers`` imports transformers; ``import autosp`` must not (it
    costs seconds, and the [hf] extra is optional)."""
    import subprocess
    import sys

    code = "import sys, autosp; print(sorted(m for m in ('transformers', 'trl', 'accelerate') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
