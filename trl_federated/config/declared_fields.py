"""The fields a config class declares as its own: those of its body and of its field mixins, the dataclasses among its
bases that are no TRL config. `declared_annotations` names them with their annotations as written (the type checks
read them, `recipes.federated_config` declares them again)."""

from __future__ import annotations

from transformers import TrainingArguments


def declaring_classes(config_class: type) -> list[type]:
    """`config_class` and its field mixins, in the order of their fields: the dataclasses of its MRO before the first
    TRL config (or federated config) it extends. A dataclass takes its bases' fields in reverse MRO order, then its
    own, so a base listed later declares fields that come earlier."""
    classes = []
    for cls in config_class.__mro__:
        if cls is not config_class and issubclass(cls, TrainingArguments):
            break
        if "__dataclass_fields__" in vars(cls):
            classes.append(cls)
    return classes[::-1]


def declared_annotations(config_class: type) -> dict[str, str]:
    """The fields `config_class` declares (`declaring_classes`), in the order they are declared, each with its
    annotation as written: a string (`from __future__ import annotations`), where a parser may have replaced the
    field's `type` with the type the string names."""
    return {name: annotation for cls in declaring_classes(config_class)
            for name, annotation in vars(cls).get("__annotations__", {}).items()}  # fmt: skip
