"""Fast generation as the server core sees it: an interface (`FastGeneration`) that the client side fills
(`local.fast_generation` registers its merged-weights generation, `register_fast_generation`), so that the core's
evaluation generates fast without importing the client side.

The module that fills it is imported by name when the core first asks (`fast_generation_engine`), as a registry of
`choices` imports the package that fills it: a name, not an import, so that no layer below the client side imports
it."""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

# The module that registers the package's fast generation when it is imported.
FILLED_BY = "trl_federated.local.fast_generation"


class FastGeneration(Protocol):
    """What evaluation needs of fast generation: why a model cannot use it (None: it can), the weights dtype a
    `generation_dtype` name resolves to on a device, and a generator (a model's `generate` on merged weights,
    refreshed from the model)."""

    def unsupported_reason(self, model: Any) -> str | None: ...

    def resolve_generation_dtype(self, name: str, device: torch.device) -> torch.dtype: ...

    def merged_generator(self, model: Any, dtype: torch.dtype) -> Any: ...


_engine: FastGeneration | None = None


def register_fast_generation(engine: FastGeneration) -> None:
    """Make `engine` the fast generation the core's evaluation uses."""
    global _engine
    _engine = engine


def fast_generation_engine() -> FastGeneration:
    """The registered fast generation, importing the module that fills it (`FILLED_BY`) the first time."""
    if _engine is None:
        importlib.import_module(FILLED_BY)
    return _engine
