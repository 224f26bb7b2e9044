"""The fields a config class declares as its own: those of its body and of its field mixins, the dataclasses among its
bases that are no TRL config (`FedGRPOConfig`'s: `fields.FederationFields`, `robustness_fields.RobustnessFields`,
`privacy_fields.PrivacyFields`), each documenting its fields in its own `Parameters:`. `declared_annotations` names
them with their annotations as written (the type checks read them, `recipes.federated_config` declares them again),
and `documents_field_mixins` gives the config's docstring its field mixins' `Parameters:` entries."""

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


def documents_field_mixins(config_class: type) -> type:
    """Class decorator, after `@dataclass`: `config_class`'s docstring with its field mixins' `Parameters:` entries
    before its own, in the order of the fields, so that its `Parameters:` documents every field it declares where the
    configuration reference (`docs/gen_config_reference.py`) and `help()` read it."""
    head, own = config_class.__doc__.split("Parameters:\n", 1)
    mixins = [cls.__doc__.split("Parameters:\n", 1)[1].rstrip() for cls in declaring_classes(config_class)
              if cls is not config_class]
    config_class.__doc__ = head + "Parameters:\n" + "\n\n".join([*mixins, own])
    return config_class
