"""No import cycle among the modules of fastlm/ and benchmarks/.

Two modules that import each other (directly or through others) are a sign that a shared piece
lives in the wrong file: whichever is imported first sees the other half-initialised, and a
function-level import that hides the cycle from Python still hides it from the reader. The graph
is read from the source with `ast` (every import statement, at module level or inside a function),
so nothing is executed: a module's edges go to the fastlm or benchmarks modules it names.
`from package import name` goes to `package.name` when that is a module and to the package's
`__init__` otherwise; importing a submodule is not counted as importing its package's `__init__`
(Python runs that first, but the package is not the submodule's dependency).
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    """Module name -> file: fastlm's dotted names, benchmarks' scripts by their bare names (they
    put their folder on sys.path and import each other as `import hot_loop`)."""
    modules = {}
    for path in (REPO / "fastlm").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    for path in (REPO / "benchmarks").glob("*.py"):
        modules[path.stem] = path
    return modules


def _targets(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _targets(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_must():
    """The reader finds the edges the checks below rely on (a parser that found none would pass
    the cycle test whatever the code does)."""
    graph = import_graph()
    assert "fastlm.backend" in graph["fastlm.kernels._common"]
    assert "fastlm.kernels._vocab_blocks" in graph["fastlm.kernels.cross_entropy_options"]
    assert "fastlm.kernels.cross_entropy_options" in graph["fastlm.kernels.cross_entropy"]
    assert "hot_loop" in graph["compile_report"]
    assert {"compile_report", "hot_loop"} <= graph["attention_hot_loops"]


def test_cycles_are_found():
    """The cycle finder on a made-up graph: a three-module loop and a pair, beside a chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "f"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "modules that import each other (move the shared piece): " + "; ".join(
        " <-> ".join(component) for component in found
    )
