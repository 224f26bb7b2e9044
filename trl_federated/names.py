"""The names a user writes: an import path (`package.module:name`), and, for a name that is not among its
choices, the closest one (or, for an argument of TRL's scripts that this package does not take, what to use instead).
One helper for the YAML keys and flags of `trl-federated run`, a Flower app's run-config keys, the reward functions and
the trainer and config classes named by import path. And the names a module offers from elsewhere, imported when first
used (`lazy_attributes`)."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Arguments of TRL's scripts (`ScriptArguments`, `DatasetMixtureConfig`) that this package does not take, with what to
# use instead: an unknown key or flag of that name gets this advice rather than the closest spelling.
TRL_SCRIPT_EQUIVALENTS = {
    "dataset_streaming": "A federation partitions every client's rows before training, so it cannot stream the "
    "dataset: drop `dataset_streaming`.",
    "datasets": "TRL's dataset mixtures are not supported: give one dataset as `dataset_name` (with "
    "`dataset_config` and the `dataset_*_split` fields).",
    "streaming": "A federation partitions every client's rows before training, so it cannot stream the dataset.",
    "test_split_size": "Give the evaluation rows as a split of `dataset_name`, named by `dataset_test_split`.",
}


def closest_key_hint(key: str, candidates: Iterable[str]) -> str:
    """What to say after "unknown key `key`": for an argument of TRL's scripts that this package does not take, its
    equivalent (`TRL_SCRIPT_EQUIVALENTS`); else " Did you mean `<the closest candidate>`?" (difflib), or "" when none
    is close. One helper for the YAML keys and flags of `trl-federated run` and for a Flower app's run-config keys."""
    equivalent = TRL_SCRIPT_EQUIVALENTS.get(key.lstrip("-").replace("-", "_"))
    if equivalent is not None:
        return f" {equivalent}"
    close = difflib.get_close_matches(key, list(candidates), n=1)
    return f" Did you mean `{close[0]}`?" if close else ""


def import_object(path: str, field_name: str, kind: str = "name"):
    """The object `path` names, 'package.module:name' or 'package.module.name', importable from the working directory
    (as `trl grpo` imports its dotted reward paths, though only while importing it: `sys.path` is left as it was); any
    failure is a ValueError naming `field_name` and the path."""
    module_name, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"`{field_name}` must be 'package.module:{kind}' or 'package.module.{kind}', got {path!r}.")
    # The working directory is importable for this import only: left first on `sys.path`, any later import of any
    # name would look there first, and a file of that name in the folder a run starts from would shadow a package.
    cwd = str(Path.cwd())
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"`{field_name}` {path!r}: cannot import module {module_name!r} ({error}).") from error
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    if not hasattr(module, name):
        public = [attribute for attribute in dir(module) if not attribute.startswith("_")]
        raise ValueError(
            f"`{field_name}` {path!r}: module {module_name!r} has no attribute {name!r}."
            f"{closest_key_hint(name, public)}"
        )
    return getattr(module, name)


def import_class(path: str, base: type, field_name: str) -> type:
    """The class `path` names (`import_object`), which must subclass `base`; any failure is a ValueError naming
    `field_name` and the path."""
    cls = import_object(path, field_name, kind="Class")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"`{field_name}` {path!r} is {cls!r}, not a subclass of `{base.__module__}.{base.__name__}`.")
    return cls


def lazy_attributes(namespace: dict[str, Any], homes: dict[str, str]):
    """A module's `__getattr__` (PEP 562) for the names it offers from other modules, `homes` (name -> module, relative
    to the module's package): each name imports its module when first read, then stays in `namespace` (the module's
    `globals()`). Importing the module then imports none of them: `import trl_federated` and `trl-federated --version`
    take no time for torch, transformers and TRL, which a command-line typo or `--help` never needs."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], namespace["__package__"]), name)
        namespace[name] = value
        return value

    return __getattr__
