"""The example configs shipped with the package, by name: `trl-federated run --config quickstart` reads the packaged
copy of `examples/configs/quickstart.yaml` where no such file is at hand (a pip install has no clone), and
`--accelerate_config cpu_two_processes` the copy of `examples/accelerate/cpu_two_processes.yaml`, as `trl grpo
--accelerate_config zero2` names TRL's; `trl-federated new-app DIR` writes the copy of the example Flower app's
`examples/flower/pyproject.toml` (`new_flower_app`). The copies in `trl_federated/examples/` are the repository's
`examples/` files, byte for byte (tests/test_shipped.py checks them); `examples/` is their source."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The packaged copies, in the layout of the repository's `examples/`: `configs/` (run configs), `accelerate/`.
SHIPPED = Path(__file__).resolve().parents[1] / "examples"


def shipped_names(folder: str) -> list[str]:
    """The names `shipped_file` takes in `folder`: each packaged YAML's path under it, without `.yaml`."""
    root = SHIPPED / folder
    return sorted(str(path.relative_to(root).with_suffix("")) for path in root.rglob("*.yaml"))


def shipped_file(value: str, folder: str) -> str:
    """`value` when it is a file; else the packaged YAML of `folder` it names (`quickstart`, `quickstart.yaml`,
    `paper/fgrpo`, or a path whose end names one, `examples/configs/quickstart.yaml` outside a clone); else `value`,
    for the reader to refuse."""
    if Path(value).is_file():
        return value
    name = value.removesuffix(".yaml").removeprefix(f"examples/{folder}/")
    candidate = SHIPPED / folder / f"{name}.yaml"
    return str(candidate) if name and candidate.is_file() else value


def take_option(args: list[str], option: str, error: Callable[[str], Any]) -> tuple[str | None, list[str]]:
    """(the value of `option` in `args`, the other arguments); (None, `args`) without it; `error` when it ends the
    arguments without a value."""
    if option not in args:
        return None, args
    at = args.index(option)
    if at + 1 == len(args):
        return error(f"{option} needs a value (a file, or one of {shipped_names('accelerate')})"), args
    return args[at + 1], args[:at] + args[at + 2 :]


def with_shipped_config(args: list[str]) -> list[str]:
    """`args` with the value of `--config` resolved by `shipped_file` (a file, else a packaged run config's name)."""
    if "--config" not in args[:-1]:
        return args
    at = args.index("--config") + 1
    return [*args[:at], shipped_file(args[at], "configs"), *args[at + 1 :]]


def new_flower_app(folder: Path) -> Path:
    """Make `folder` (new, or an empty folder) a Flower app, as `flwr new` makes one, and return its pyproject.toml:
    the example app's (`examples/flower/pyproject.toml`), whose ServerApp and ClientApp are the packaged
    `trl_federated.flower.fgrpo_app` and whose run config is the quickstart's federation on the embedded model, with
    the project named after the folder. A folder that holds anything, or a file, is refused (`FileExistsError`) and
    left as it is."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} is not an empty folder: name a new one (nothing was written).")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", folder.resolve().name).strip("._-") or "fgrpo-app"  # a PEP 508 name
    text = (SHIPPED / "flower" / "pyproject.toml").read_text(encoding="utf-8")
    folder.mkdir(parents=True, exist_ok=True)
    pyproject = folder / "pyproject.toml"
    pyproject.write_text(text.replace('name = "fgrpo-app"', f'name = "{name}"', 1), encoding="utf-8")
    return pyproject
