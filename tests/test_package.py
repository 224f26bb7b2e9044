"""The package's modules import each other in layers: no import cycle, deferred imports included."""

import ast
from pathlib import Path

import trl_federated

PACKAGE = Path(trl_federated.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports at run time, at any depth (functions included; `if TYPE_CHECKING:`
    blocks left out, since they never run)."""
    tree = ast.parse(path.read_text())
    type_checking = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            root = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            names = [root] + [f"{root}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in modules}
    return found - {module_name(path)}


def test_no_module_imports_a_module_that_imports_it_back():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imported_modules(path, set(paths)) for name, path in paths.items()}
    # a package's __init__ re-exports its modules; importing one of them imports the package first, which is no cycle
    graph = {
        name: {target for target in targets if not name.startswith(target + ".")} for name, targets in graph.items()
    }
    cycles = []

    def visit(name, stack):
        if name in stack:
            cycles.append(stack[stack.index(name):] + [name])
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, stack + [name])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)
    assert "trl_federated.runner" in graph["trl_federated.trainer"]  # the drop-in trainer sits above the runner
