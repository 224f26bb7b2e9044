"""The configuration reference page, generated from the code: never written twice.

`FedGRPOConfig`'s `Parameters:` docstring (sections `> Title`, then `name (`type`, ...):` entries, its field mixins'
first: `declared_fields.documents_field_mixins`) gives the federation's fields and the GRPO defaults it changes;
`FedDAPOConfig` and `FedGSPOConfig` the recipes' defaults; the field help of `BenchmarkArguments` the data and reward
flags. `render()` returns the page; the MkDocs hook (`docs/hooks.py`) adds it to the site as `config-reference.md` on
every build, and `python docs/gen_config_reference.py` prints it.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap

PAGE = "config-reference.md"
ENTRY = re.compile(r"^(?P<name>\w+) \((?P<spec>.*)\):$")


def plain(text: str) -> str:
    """Doc-builder cross references ([`~trl.GRPOConfig`], [`FedDAPOConfig`]) as code spans."""
    return re.sub(r"\[`~?([\w.]+)`\]", r"`\1`", text)


def parameters(cls) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The `Parameters:` block of `cls`'s docstring: [(section title, [(name, type and default, description)])]."""
    doc = textwrap.dedent((cls.__doc__ or "").strip("\n"))
    if "Parameters:" not in doc:
        raise ValueError(f"{cls.__name__}'s docstring has no `Parameters:` block")
    block = textwrap.dedent(doc.split("Parameters:", 1)[1])
    sections: list[tuple[str, list[tuple[str, str, str]]]] = [("", [])]
    entry: list[str] | None = None
    for line in block.splitlines():
        if not line.strip():
            continue
        if line.startswith("> "):
            sections.append((line[2:].strip(), []))
        elif not line.startswith(" ") and (match := ENTRY.match(line)):
            entry = [match["name"], match["spec"], ""]
            sections[-1][1].append(entry)  # type: ignore[arg-type]
        elif line.startswith(" ") and entry is not None:
            entry[2] = f"{entry[2]} {line.strip()}".strip()
        else:
            raise ValueError(f"{cls.__name__}'s `Parameters:`: neither a section nor an entry: {line!r}")
    return [(title, [tuple(e) for e in entries]) for title, entries in sections if entries]  # type: ignore[misc]


def declared_fields(cls) -> dict[str, dataclasses.Field]:
    """The dataclass fields `cls` declares, itself or through its field mixins (not those it inherits unchanged)."""
    from trl_federated.config.declared_fields import declared_annotations

    own = declared_annotations(cls)
    return {f.name: f for f in dataclasses.fields(cls) if f.name in own}


def check_documented(cls) -> list[str]:
    """Every field `cls` declares has a `Parameters:` entry, and every entry names a field of `cls`."""
    documented = {name for _, entries in parameters(cls) for name, _, _ in entries}
    declared = set(declared_fields(cls))
    fields = {f.name for f in dataclasses.fields(cls)}
    return [f"{cls.__name__}.{name}: declared but not in `Parameters:`" for name in sorted(declared - documented)] + [
        f"{cls.__name__}: `Parameters:` documents `{name}`, which is no field" for name in sorted(documented - fields)
    ]


def _entry(name: str, spec: str, description: str) -> str:
    return f"- **`{name}`** ({plain(spec)}), flag `--{name}`: {plain(description)}"


def _default(item: dataclasses.Field) -> str:
    if item.default is not dataclasses.MISSING:
        return f"`{item.default!r}`"
    if item.default_factory is not dataclasses.MISSING:
        return f"`{item.default_factory()!r}`"
    return "required"


def render() -> str:
    from trl_federated.arguments import BenchmarkArguments
    from trl_federated.config import FedDAPOConfig, FedGRPOConfig, FedGSPOConfig

    problems = [problem for cls in (FedGRPOConfig, FedDAPOConfig, FedGSPOConfig) for problem in check_documented(cls)]
    if problems:
        raise ValueError("the config docstrings and fields disagree:\n" + "\n".join(problems))
    intro = textwrap.dedent(FedGRPOConfig.__doc__.strip("\n")).split("Parameters:", 1)[0].split("\n\n", 1)[1]
    lines = [
        "# Configuration reference",
        "",
        "Generated when the docs build (`docs/gen_config_reference.py`) from `FedGRPOConfig`'s `Parameters:`",
        "docstring (and its field mixins', beside it in `trl_federated/config/`), the recipes' docstrings and",
        "`BenchmarkArguments`' field help: edit those, not this page. Every field is a YAML key of",
        "`trl-federated run --config` and a `--flag` of the same name; every other `trl.GRPOConfig` field (TRL's",
        "documentation) and TRL's `ModelConfig` (`model_name_or_path`, `lora_*`) parse the same way. In a Flower app's",
        "run config each is the kebab-case key (`num_rounds` is `num-rounds`).",
        "",
        plain(intro.strip()),
        "",
        "## `FedGRPOConfig`",
    ]
    for title, entries in parameters(FedGRPOConfig):
        lines += ["", f"### {plain(title)}", ""] + [_entry(*entry) for entry in entries]
    for cls, flag in ((FedDAPOConfig, "dapo"), (FedGSPOConfig, "gspo")):
        summary = plain(textwrap.dedent(cls.__doc__.strip("\n")).split("Parameters:", 1)[0].strip())
        lines += ["", f"## `{cls.__name__}` (`--algorithm {flag}`)", "", " ".join(summary.split()), "",
                  "Defaults that differ from `FedGRPOConfig`'s:", ""]  # fmt: skip
        lines += [_entry(*entry) for _, entries in parameters(cls) for entry in entries]
    lines += ["", "## `BenchmarkArguments`: the data and the rewards", ""]
    lines += [plain(BenchmarkArguments.__doc__.strip()), ""]
    for item in dataclasses.fields(BenchmarkArguments):
        help_text = " ".join(str(item.metadata.get("help", "")).split())
        lines.append(f"- **`{item.name}`** (default {_default(item)}), flag `--{item.name}`: {plain(help_text)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
