"""Server optimizers: how the pseudo-gradient Δ moves the global adapter (Eqs. momentum, model_update).

Like Flower's FedOpt family (Reddi et al., "Adaptive Federated Optimization", ICLR 2021), the server treats Δ
as a gradient-ascent direction. One class per step, each a file, and one registration line each below
(`choices.SERVER_OPTIMIZERS` names them for `FedGRPOConfig`):

- `ServerSGD` ("sgd"): θ + α Δ; with α = 1, FedAvg's weighted average.
- `ServerAdam` ("adam"): the paper's literal step (Eqs. momentum, model_update: ε = 1e-8, no bias correction),
  which moves every coordinate by about α whatever Δ's size.
- `ServerFedAdam` ("fedadam"): Adam with ε on the update's own scale (τ from each tensor's first Δ), v started at
  τ², m bias-corrected, as Reddi et al.'s FedAdam takes τ ≫ 1e-8; near FedAvg's step where Δ is typical.
- `ServerNormMatchedAdam` ("adam-norm"): Adam's direction, scaled per tensor to the norm of that tensor's Δ.
- `ServerNesterov` ("nesterov"): Nesterov outer momentum, DiLoCo's outer step (Douillard et al., 2023).
"""

from __future__ import annotations

from ...choices import SERVER_OPTIMIZERS
from .adam import ServerAdam
from .adam_norm import ServerNormMatchedAdam
from .base import ServerOptimizer
from .fedadam import ServerFedAdam
from .nesterov import ServerNesterov
from .sgd import ServerSGD


def register_server_optimizer(name: str, optimizer_class: type[ServerOptimizer]) -> None:
    """Make `name` a value of `FedGRPOConfig.server_optimizer` (`choices.SERVER_OPTIMIZERS`, the one registry of the
    server optimizers' names): `optimizer_class.from_config` builds it, its `default_learning_rate` and
    `default_epsilon` are what an unset `server_learning_rate` and `server_epsilon` take, its `config_errors` checks
    the config. The command line offers it from then on."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ServerOptimizer)):
        raise TypeError(f"`optimizer_class` must be a ServerOptimizer subclass, got {optimizer_class!r}.")
    SERVER_OPTIMIZERS[name] = optimizer_class


register_server_optimizer("adam", ServerAdam)
register_server_optimizer("sgd", ServerSGD)
register_server_optimizer("fedadam", ServerFedAdam)
register_server_optimizer("adam-norm", ServerNormMatchedAdam)
register_server_optimizer("nesterov", ServerNesterov)


__all__ = [
    "ServerAdam",
    "ServerFedAdam",
    "ServerNesterov",
    "ServerNormMatchedAdam",
    "ServerOptimizer",
    "ServerSGD",
    "register_server_optimizer",
]
