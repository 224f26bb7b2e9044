"""What a server step is (`ServerOptimizer`): how the pseudo-gradient Δ moves the global adapter (Eqs. momentum,
model_update), one block of the adapter at a time."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..blocks import blocks

if TYPE_CHECKING:
    from ...config import FedGRPOConfig


class ServerOptimizer(ABC):
    """Applies Δ to θ; subclasses keep their state explicit and serialisable.

    A step is `start_step()` followed by `step_block()` on every part of the adapter exactly once, so that the
    aggregator can compute Δ and apply it one cache-sized block at a time (see `blocks`); `step()` does all of it
    for a whole Δ.
    """

    # What an unset `server_learning_rate` takes (None: derived from the local budget, `FedGRPOConfig`), what an unset
    # `server_epsilon` takes, and whether the step reads an ε at all.
    default_learning_rate: float | None = 1.0
    default_epsilon: float | None = None
    takes_epsilon = False

    def __init__(self, learning_rate: float):
        if not learning_rate > 0:
            raise ValueError(f"Server `learning_rate` must be > 0, got {learning_rate}.")
        self.learning_rate = learning_rate

    @classmethod
    def config_errors(cls, args: FedGRPOConfig) -> Iterable[str]:
        """One message per field of `args` this step reads that is out of its range (the config raises the first):
        a step with hyperparameters of its own checks them here."""
        return ()

    @classmethod
    @abstractmethod
    def from_config(cls, args: FedGRPOConfig) -> ServerOptimizer:
        """The step with the config's `server_learning_rate` and the `server_*` fields it reads."""

    def step(self, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the new parameters (same keys and dtypes as `params`); `params` is left untouched."""
        self.start_step()
        new = {}
        for keys in blocks(params):
            new.update(self.step_block({key: params[key] for key in keys}, {key: delta[key] for key in keys}))
        return new

    def start_step(self) -> None:
        """Open a server step; its `step_block` calls follow."""

    @abstractmethod
    def step_block(self, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new values of the part `params` of the adapter, given its part of Δ; `params` is left untouched."""

    def block_state(self, keys: list[str]) -> dict[str, Any]:
        """The state of the part `keys` of the adapter, as the last `step_block` left it (nested dicts of tensors, as
        `state_dict`), for the aggregator's checks."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
