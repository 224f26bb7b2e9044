"""The package's import graph, read from its source (an AST walk over `trl_federated/`, every import statement,
those inside functions and under `TYPE_CHECKING` included): no circle, and no import that runs up the layers.

A module's layer says what it may know about: only its own layer and those below. A new module takes its place in
`LAYERS` here, which is the architecture section of the README in code."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trl_federated"
ROOT = "trl_federated"

# Bottom first. Imports go to the same layer or one below, never above.
LAYERS = {
    "leaves and the tensor layer": {
        "choices", "names", "sampling", "adapters", "methods", "testing", "flower.stream", "aggregation.blocks",
        "wire", "wire.codec", "wire.exact", "wire.cast", "wire.blockwise",
        "runtime", "runtime.devices", "runtime.distributed", "runtime.memory", "runtime.vllm_server", "runtime.models",
        "runtime.generation", "runtime.master_weights", "runtime.notices",
    },
    "configuration, data and rewards": {
        "config", "config.fields", "config.building", "config.checks", "config.server_step", "config.results",
        "config.recipes", "config.declared_fields", "config.robustness_fields", "config.privacy_fields",
        "data", "data.reasoning_gym", "data.paper", "data.partition", "data.loading",
        "scoring", "scoring.answer_check", "scoring.rewards",
    },
    "aggregation": {
        "aggregation", "aggregation.base", "aggregation.server_optim", "aggregation.server_optim.base",
        "aggregation.server_optim.sgd", "aggregation.server_optim.adam", "aggregation.server_optim.fedadam",
        "aggregation.server_optim.adam_norm", "aggregation.server_optim.nesterov",
        "aggregation.robust", "aggregation.robust.base",
        "aggregation.robust.trimmed_mean", "aggregation.robust.median", "aggregation.robust.krum",
        "aggregation.robust.bulyan", "aggregation.fedavg",
        "aggregation.rpg", "aggregation.scaffold", "aggregation.update", "aggregation.privacy",
        "aggregation.privacy.client_level", "aggregation.privacy.adaptive_clipping", "aggregation.privacy.record_level",
        "aggregation.privacy.ledger", "aggregation.privacy.release_ledger",
    },
    "local training": {
        "local", "local.shared_prefix", "local.informative_rows", "local.gated_mlp", "local.frozen_casts",
        "local.fast_generation", "local.speedups", "local.record_privacy", "local.local_trainer", "local.client",
    },
    "server core": {
        "core", "core.round_record", "core.callbacks", "core.evaluation", "core.admission", "core.checkpoint",
        "core.run_identity", "core.server",
    },
    "reports": {"reports", "reports.summary", "reports.round_log", "reports.hub", "reports.compare"},
    "arguments": {"arguments", "arguments.flags", "arguments.known_flags", "arguments.parsing", "arguments.shipped"},
    "transports and drivers": {
        "runner", "trainer", "federation", "flower", "flower.records", "flower.identity", "flower.run_config",
        "flower.strategy",
        "flower.apps", "flower.flwr_run", "flower.fgrpo_app",
    },
    "command line": {"cli", ""},
}  # fmt: skip
# The modules `config` may import: the configuration reads its choices and checks, and imports no implementation.
CONFIG_IMPORTS = {
    "choices", "runtime.devices", "sampling",
    "config.fields", "config.building", "config.checks", "config.server_step", "config.results", "config.recipes",
    "config.declared_fields", "config.robustness_fields", "config.privacy_fields",
}


def package_modules() -> dict[str, Path]:
    """Every module of the package, by its name relative to the package ("" for the package itself)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module `name` imports, anywhere in its source."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [part for part in package if part]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([ROOT, *base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from . import x` names the module x; `from .m import f` names m.
            targets = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target != ROOT and not target.startswith(ROOT + "."):
                continue
            relative = target.removeprefix(ROOT).removeprefix(".")
            while relative not in modules and "." in relative:  # the longest prefix that is a module
                relative = relative.rsplit(".", 1)[0]
            if relative not in modules:
                relative = ""  # a name of the package itself
            found.add(relative)
    found.discard(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    placed = [name for layer in LAYERS.values() for name in layer]
    assert len(placed) == len(set(placed)), "a module is placed in two layers"
    assert set(graph) == set(placed), (
        f"unplaced: {sorted(set(graph) - set(placed))}; gone: {sorted(set(placed) - set(graph))}"
    )


def test_no_import_runs_up_the_layers(graph):
    level = {name: index for index, layer in enumerate(LAYERS.values()) for name in layer}
    names = list(LAYERS)
    upward = [
        f"{module or ROOT} ({names[level[module]]}) imports {target} ({names[level[target]]})"
        for module, targets in graph.items() for target in targets if level[target] > level[module]
    ]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_circle(graph):
    # Tarjan's strongly connected components: any with more than one module is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not circles, circles


def test_config_is_a_leaf(graph):
    # `config` and everything it imports: its choices, the device check, the participation rule. No implementation.
    seen, todo = set(), ["config"]
    while todo:
        module = todo.pop()
        for target in graph[module] - seen:
            seen.add(target)
            todo.append(target)
    assert seen <= CONFIG_IMPORTS, sorted(seen - CONFIG_IMPORTS)


def test_the_tensor_layer_is_at_the_bottom(graph):
    # `adapters` (AdapterState and its arithmetic, the wire format) knows only the configuration's choices, and
    # nothing below the aggregation package imports it.
    assert graph["adapters"] <= {"choices"}, graph["adapters"]
    below = [name for layer in list(LAYERS.values())[:2] for name in layer]
    assert not [name for name in below if any(target.startswith("aggregation") for target in graph[name])]


def test_the_server_core_imports_nothing_human_facing(graph):
    # The reports (log lines, advice, summary.md, plots, the model card and the Hub) hang on the core's events; the
    # drivers attach them. The core knows no driver, transport or command line either.
    core = [name for name in graph if name == "core" or name.startswith("core.")]
    above = ("reports", "arguments", "cli", "runner", "trainer", "flower")
    found = {name: sorted(target for target in graph[name] if target.split(".")[0] in above) for name in core}
    assert not any(found.values()), found


def test_the_command_line_only_parses_and_dispatches(graph):
    # Parsing is `arguments`, which the Flower app imports; nothing in the package imports `cli` but the package.
    importers = sorted(name for name, targets in graph.items() if "cli" in targets)
    assert importers == [], importers
    assert not [name for name in graph if name.startswith("flower") and "cli" in graph[name]]
    # nor does a benchmark or its harness (the one that profiles a run calls the `trl-federated` console script)
    importers = [name for name, imported in benchmark_imports().items() if f"{ROOT}.cli" in imported]
    assert importers == [], importers


def test_the_folders_are_the_layers_and_few_modules_sit_flat():
    # At most 12 modules at the top of the package; every folder's modules share one layer (the leaves that a folder
    # keeps beside its layer, `flower.stream` and `aggregation.blocks`, excepted).
    flat = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert len(flat) <= 12, flat
    level = {name: index for index, layer in enumerate(LAYERS.values()) for name in layer}
    folders = {}
    for name in level:
        if "." in name and name not in ("flower.stream", "aggregation.blocks"):
            folders.setdefault(name.split(".")[0], set()).add(level[name])
    assert all(len(levels) == 1 for levels in folders.values()), folders


def test_no_module_but_the_configs_fields_runs_over_600_lines():
    # `config.fields` lists the configuration's fields, each with its help and its `Parameters:` entry, but those of
    # the concerns that have their own field mixin (`config.robustness_fields`, `config.privacy_fields`); any other
    # module that grows past 600 lines holds more than one concept, and `config.fields` past 900 a concern to move out.
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in package_modules().items()}
    long = {name: lines for name, lines in lengths.items() if lines > 600 and name != "config.fields"}
    assert not long, long
    assert lengths["config.fields"] <= 900, lengths["config.fields"]


def benchmark_imports() -> dict[str, set[str]]:
    """Every module each file of benchmarks/ (its harness included) imports, by the file's path there: `import a.b`
    and `from a.b import c` name a.b, the latter a.b.c too (c may be a module)."""
    benchmarks = PACKAGE.parent / "benchmarks"
    found = {}
    for path in [*benchmarks.glob("*.py"), *(benchmarks / "harness").glob("*.py")]:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        found[str(path.relative_to(benchmarks))] = imported
    return found


def test_the_benchmark_scripts_import_the_harness_not_each_other():
    # Each script under benchmarks/ imports the harness (benchmarks/harness/) and the package, never another script.
    scripts = {path.stem for path in (PACKAGE.parent / "benchmarks").glob("*.py")}
    found = {name: sorted(module for module in imported if module.split(".")[0] in scripts)
             for name, imported in benchmark_imports().items()}
    assert not any(found.values()), {name: modules for name, modules in found.items() if modules}


# The top-level names the folders' modules had before the layers (`core/server.py` was `trl_federated/server.py`): none
# imports any more, so a reader finds each module at one path.
OLD_MODULES = (
    "answer_check", "rewards", "evaluation", "devices", "distributed", "memory", "vllm_server", "models",
    "master_weights", "shared_prefix", "gated_mlp", "fast_generation", "speedups", "local_trainer", "client", "server",
    "admission", "round_record", "callbacks", "checkpoint", "run_identity", "reporting", "hub", "compare",
)  # fmt: skip


def test_no_old_module_path_imports():
    import importlib

    for old in OLD_MODULES:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"{ROOT}.{old}")
    # nor the names a module offered from another's: the command line's parsing, loading and reward helpers, the
    # config's choice lists (each is imported from its own module: `arguments`, `scoring.rewards`, `choices`)
    import trl_federated.cli
    import trl_federated.config

    assert not [name for name in ("parse_run_args", "load_model", "reward_functions")
                if hasattr(trl_federated.cli, name)]
    assert not [name for name in ("SERVER_OPTIMIZERS", "ROBUST_AGGREGATIONS") if hasattr(trl_federated.config, name)]


def test_local_trainer_is_the_function_in_every_import_order():
    # `trl_federated.local_trainer` is the public function; no module of that name at the top of the package hides it,
    # whether the function or its module (`local/local_trainer.py`) is imported first (each order in a fresh
    # interpreter, where a module is imported once).
    import subprocess
    import sys

    read = "from trl_federated import local_trainer\nassert inspect.isfunction(local_trainer), local_trainer\n"
    module = "import trl_federated.local.local_trainer\n"
    for probe in (read + module + read, module + read):
        subprocess.run([sys.executable, "-c", "import inspect\n" + probe], check=True, cwd=PACKAGE.parent)


def test_the_core_imports_nothing_of_the_client_side_and_names_no_method(graph):
    # The server core knows an aggregation, a server step, a robust combiner and a wire format only through their
    # interfaces and registries, and the client side (`local/`) not at all: it asks the aggregator for its round
    # metrics and gets fast generation through `runtime.generation`, which the client side fills.
    from trl_federated import choices

    core = {name: path for name, path in package_modules().items() if name == "core" or name.startswith("core.")}
    local = [f"{name} imports {target}" for name in core for target in graph[name]
             if target == "local" or target.startswith("local.")]
    assert not local, local
    # each registry's implementations: an aggregation's class, a server step's or combiner's class, a codec's class
    implementations = [getattr(entry, "aggregator_class", entry) for registry in registries(choices).values()
                       for entry in registry.values() if entry is not None]
    methods = {(item if isinstance(item, type) else type(item)).__name__ for item in implementations}
    assert {"RPGAggregator", "ServerAdam", "Krum", "Blockwise"} <= methods
    named = [f"{name} names {node.id if isinstance(node, ast.Name) else getattr(node, 'attr', None) or node.name}"
             for name, path in core.items() for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if (isinstance(node, ast.Name) and node.id in methods)
             or (isinstance(node, ast.Attribute) and node.attr in methods)
             or (isinstance(node, ast.alias) and node.name in methods)]
    assert not named, named


def test_no_aggregation_module_is_over_400_lines():
    # One idea a module: a strategy, a server step, a combiner, a part of privacy (Flower's strategies: ~200 lines).
    long = {str(path.relative_to(PACKAGE)): lines for path in sorted((PACKAGE / "aggregation").rglob("*.py"))
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long, long


def registries(choices_module) -> dict:
    """The registries of `choices`, by name."""
    return {name: value for name, value in vars(choices_module).items() if isinstance(value, choices_module.Registry)}


def test_every_kind_of_choice_has_a_registry():
    # Each kind of implementation a config names by a value (the aggregation, its server step, the robust combiner,
    # the wire format) is a registry of `choices`, filled by one registration line per name; the other choice
    # fields are settings of one implementation (a tuple of `choices`).
    from trl_federated import choices

    assert set(registries(choices)) == {"AGGREGATIONS", "SERVER_OPTIMIZERS", "ROBUST_AGGREGATIONS", "TRANSFER_DTYPES"}
    from trl_federated.config import FedGRPOConfig

    fields = FedGRPOConfig.__dataclass_fields__
    for field_name in ("aggregation", "server_optimizer", "robust_aggregation", "transfer_dtype"):
        assert isinstance(fields[field_name].metadata["choices"], choices.Registry), field_name


# The core modules, each with its own test file, tests/test_<name>.py (other tests of it may live where their concern
# is: a resume in test_reliability.py, an attack in test_untrusted.py).
TESTED_BY_NAME = (
    "core.server", "core.admission", "core.checkpoint", "core.run_identity", "core.callbacks", "core.evaluation",
    "reports.round_log", "aggregation.rpg", "aggregation.scaffold", "aggregation.robust", "aggregation.server_optim",
    "aggregation.privacy", "config", "runner", "trainer", "cli", "methods",
)  # fmt: skip


def test_the_core_modules_tests_are_found_by_their_names():
    tests = PACKAGE.parent / "tests"
    missing = [name for name in TESTED_BY_NAME if not (tests / f"test_{name.rsplit('.', 1)[-1]}.py").is_file()]
    assert not missing, missing


def test_every_import_path_the_docs_show_still_imports():
    # Every `from trl_federated... import name` and `trl_federated.a.b` the README and docs show imports.
    import importlib
    import re

    root = PACKAGE.parent
    texts = [(root / "README.md").read_text(encoding="utf-8")]
    texts += [path.read_text(encoding="utf-8") for path in sorted((root / "docs").glob("*.md"))]
    missing = []
    for text in texts:
        for module, grouped, names in re.findall(r"from (trl_federated[\w.]*) import (?:\(([^)]*)\)|([\w, ]+))", text):
            for name in filter(None, (part.strip() for part in (grouped or names).replace("\n", ",").split(","))):
                if not hasattr(importlib.import_module(module), name):
                    missing.append(f"{module}.{name}")
        for dotted in re.findall(r"`(trl_federated(?:\.\w+)+)`", text):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
                try:
                    found = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    found = getattr(found, attribute, None)
                if found is None:
                    missing.append(dotted)
                break
    assert not missing, missing
