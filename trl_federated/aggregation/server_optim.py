"""Server optimizers: how the pseudo-gradient Δ moves the global adapter (Eqs. momentum, model_update).

Like Flower's FedOpt family (Reddi et al., "Adaptive Federated Optimization", ICLR 2021), the server treats Δ
as a gradient-ascent direction. One class per step (`SERVER_OPTIMIZERS` names them for `FedGRPOConfig`):

- `ServerSGD` ("sgd"): θ + α Δ; with α = 1, FedAvg's weighted average.
- `ServerAdam` ("adam"): the paper's literal step (Eqs. momentum, model_update: ε = 1e-8, no bias correction),
  which moves every coordinate by about α whatever Δ's size.
- `ServerFedAdam` ("fedadam"): Adam with ε on the update's own scale (τ from each tensor's first Δ), v started at
  τ², m bias-corrected, as Reddi et al.'s FedAdam takes τ ≫ 1e-8; near FedAvg's step where Δ is typical.
- `ServerNormMatchedAdam` ("adam-norm"): Adam's direction, scaled per tensor to the norm of that tensor's Δ.
- `ServerNesterov` ("nesterov"): Nesterov outer momentum, DiLoCo's outer step (Douillard et al., 2023).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..choices import SERVER_OPTIMIZERS
from .blocks import blocks

if TYPE_CHECKING:
    from ..config import FedGRPOConfig


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


class ServerSGD(ServerOptimizer):
    """θ^{[t+1]} = θ^{[t]} + α Δ^{[t]}. With α = 1 the new global model is the ω-weighted average of the clients."""

    default_learning_rate = 1.0  # the weighted mean of the client models

    def __init__(self, learning_rate: float = 1.0):
        super().__init__(learning_rate)

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate)

    def step_block(self, params, delta):
        keys = list(params)
        new = torch._foreach_add(
            [params[key].float() for key in keys], [delta[key] for key in keys], alpha=self.learning_rate
        )
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}


class ServerAdam(ServerOptimizer):
    """The paper's server update (Algorithm 1, lines 22-23), element-wise:

        m^{[t]} = β1 m^{[t-1]} + (1 − β1) Δ^{[t]}              (Eq. momentum)
        v^{[t]} = β2 v^{[t-1]} + (1 − β2) (Δ^{[t]})²
        θ^{[t+1]} = θ^{[t]} + α m^{[t]} / (√v^{[t]} + ε)        (Eq. model_update)

    m and v start at 0 (m^{[-1]} = v^{[-1]} = 0) and, as in the paper, are not bias-corrected; with
    `bias_correction=True` they are divided by (1 − β^{t+1}) as in Kingma & Ba's Adam.
    """

    default_learning_rate = None  # SERVER_ADAM_SCALE × E × the local rate (`FedGRPOConfig`)
    default_epsilon = 1e-8  # the paper's (Algorithm 1)
    takes_epsilon = True

    def __init__(
        self,
        learning_rate: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.99,
        epsilon: float = 1e-8,
        bias_correction: bool = False,
    ):
        super().__init__(learning_rate)
        self.beta1, self.beta2, self.epsilon, self.bias_correction = beta1, beta2, epsilon, bias_correction
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.num_steps = 0

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, beta1=args.server_beta1, beta2=args.server_beta2,
                   epsilon=args.server_epsilon, bias_correction=args.server_bias_correction)

    def start_step(self):
        self.num_steps += 1

    def step_block(self, params, delta):
        keys = list(params)
        m, denominator, scale = self.update_moments(keys, delta)
        new = torch._foreach_addcdiv([params[k].float() for k in keys], m, denominator,
                                     value=self.learning_rate * scale)
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}

    def update_moments(self, keys: list[str], delta: dict[str, torch.Tensor]) -> tuple[list, list, float]:
        """Eq. momentum for the tensors `keys`: m and v updated in place; returns m, the denominator √v + ε (√v̂ + ε
        with bias correction) and the factor on m per unit learning rate (1 / (1 − β1^t) with bias correction)."""
        for key in keys:
            if key not in self.m:  # m^{[-1]} = v^{[-1]} = 0
                self.m[key] = torch.zeros_like(delta[key])
                self.v[key] = torch.zeros_like(delta[key])
        m, v, d = [self.m[k] for k in keys], [self.v[k] for k in keys], [delta[k] for k in keys]
        torch._foreach_lerp_(m, d, 1 - self.beta1)  # m ← β1 m + (1 − β1) Δ
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, d, d, value=1 - self.beta2)  # v ← β2 v + (1 − β2) Δ²

        scale = 1.0
        denominator = torch._foreach_sqrt(v)
        if self.bias_correction:
            scale /= 1 - self.beta1**self.num_steps
            torch._foreach_div_(denominator, math.sqrt(1 - self.beta2**self.num_steps))
        torch._foreach_add_(denominator, self.epsilon)
        return m, denominator, scale

    def block_state(self, keys):
        return {"m": {key: self.m[key] for key in keys}, "v": {key: self.v[key] for key in keys}}

    def state_dict(self):
        return {"m": dict(self.m), "v": dict(self.v), "num_steps": self.num_steps}

    def load_state_dict(self, state):
        missing = sorted({"m", "v", "num_steps"} - set(state))
        if missing:
            raise ValueError(f"Server Adam state lacks {missing}: it was not saved by a server Adam.")
        # Copies: `step` updates m and v in place, and the source (a checkpoint, another server) must not move.
        self.m = {key: tensor.clone() for key, tensor in state["m"].items()}
        self.v = {key: tensor.clone() for key, tensor in state["v"].items()}
        self.num_steps = int(state["num_steps"])


class ServerFedAdam(ServerOptimizer):
    """Adam with ε on the scale of the clients' update (Reddi et al.'s FedAdam, whose τ is tuned in [1e-5, 1e-1] and
    never 1e-8), per tensor T of the adapter:

        τ_T     = RMS(Δ_T) of the first round whose Δ_T is not zero (or `epsilon`, when given)
        m       = β1 m + (1 − β1) Δ,        m̂ = m / (1 − β1^{t+1})           (Eq. momentum, bias-corrected)
        v       = β2 v + (1 − β2) Δ²,       v^{[-1]} = τ_T²                    (v started at τ², so not corrected)
        θ^{[t+1]} = θ^{[t]} + η m̂ · 2 τ_T / (√v + τ_T)                       (Eq. model_update with α = 2 η τ_T)

    Where |Δ| is about τ (√v ≈ τ) the step is η m̂, FedAvg's step averaged over rounds; a coordinate whose Δ is far
    above the tensor's scale moves at most about 2 η τ, Adam's per-coordinate normalisation; one whose Δ is zero
    does not move beyond its momentum. So the step has the clients' own size, while the paper's literal step moves
    every coordinate by α whatever Δ.
    """

    default_learning_rate = 1.0
    default_epsilon = None  # the RMS of each tensor's first non-zero Δ, as FedAdam's τ
    takes_epsilon = True

    def __init__(self, learning_rate: float = 1.0, beta1: float = 0.9, beta2: float = 0.99,
                 epsilon: float | None = None):
        super().__init__(learning_rate)
        if epsilon is not None and not epsilon > 0:
            raise ValueError(f"FedAdam's τ (`server_epsilon`) must be > 0 or None (derived), got {epsilon}.")
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.tau: dict[str, float] = {}  # τ_T, fixed once set
        self.num_steps = 0

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, beta1=args.server_beta1, beta2=args.server_beta2,
                   epsilon=args.server_epsilon)

    def start_step(self):
        self.num_steps += 1

    def step_block(self, params, delta):
        new = {}
        correction = 1 - self.beta1**self.num_steps
        for key, value in params.items():
            d = delta[key]
            if key not in self.tau:
                rms = float(torch.linalg.vector_norm(d)) / math.sqrt(max(d.numel(), 1))
                tau = self.epsilon if self.epsilon is not None else rms
                if not tau > 0:  # nothing to scale by yet: Δ_T is zero, and so is the step
                    new[key] = value.clone()
                    continue
                self.tau[key] = tau
                self.m[key] = torch.zeros_like(d)
                self.v[key] = torch.full_like(d, tau * tau)
            tau, m, v = self.tau[key], self.m[key], self.v[key]
            m.lerp_(d, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(d, d, value=1 - self.beta2)
            step = (m / correction).mul_(2 * self.learning_rate * tau).div_(v.sqrt().add_(tau))
            new[key] = (value.float() + step).to(value.dtype)
        return new

    def block_state(self, keys):
        return {"m": {key: self.m[key] for key in keys if key in self.m},
                "v": {key: self.v[key] for key in keys if key in self.v}}

    def state_dict(self):
        return {"m": dict(self.m), "v": dict(self.v), "tau": dict(self.tau), "num_steps": self.num_steps}

    def load_state_dict(self, state):
        missing = sorted({"m", "v", "tau", "num_steps"} - set(state))
        if missing:
            raise ValueError(f"Server FedAdam state lacks {missing}: it was not saved by a server FedAdam.")
        self.m = {key: tensor.clone() for key, tensor in state["m"].items()}
        self.v = {key: tensor.clone() for key, tensor in state["v"].items()}
        self.tau = {key: float(value) for key, value in state["tau"].items()}
        self.num_steps = int(state["num_steps"])


class ServerNormMatchedAdam(ServerAdam):
    """Adam's direction at the clients' step length, per tensor T of the adapter:

        m, v as Eq. momentum, bias-corrected;  d_T = m̂_T / (√v̂_T + ε)
        θ_T^{[t+1]} = θ_T^{[t]} + η ‖Δ_T‖ d_T / ‖d_T‖

    With η = 1 no tensor moves farther than FedAvg would move it this round, and a round whose Δ is zero moves
    nothing, however long the momentum; Adam decides only the direction within each tensor (a trust ratio, as LAMB's
    per layer, taken against the update instead of the weights)."""

    default_learning_rate = 1.0

    def __init__(self, learning_rate: float = 1.0, beta1: float = 0.9, beta2: float = 0.99, epsilon: float = 1e-8):
        super().__init__(learning_rate, beta1, beta2, epsilon, bias_correction=True)

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, beta1=args.server_beta1, beta2=args.server_beta2,
                   epsilon=args.server_epsilon)

    def step_block(self, params, delta):
        keys = list(params)
        m, denominator, _ = self.update_moments(keys, delta)  # m̂'s factor cancels in d / ‖d‖
        new = {}
        for key, direction in zip(keys, torch._foreach_div(m, denominator)):
            direction_norm = float(torch.linalg.vector_norm(direction))
            scale = self.learning_rate * float(torch.linalg.vector_norm(delta[key])) / direction_norm \
                if direction_norm > 0 else 0.0
            new[key] = (params[key].float() + direction * scale).to(params[key].dtype)
        return new


class ServerNesterov(ServerOptimizer):
    """Nesterov outer momentum, DiLoCo's outer step (Douillard et al., 2023: η = 0.7, μ = 0.9), on the same
    pseudo-gradient:

        m^{[t]} = μ m^{[t-1]} + Δ^{[t]},   m^{[-1]} = 0
        θ^{[t+1]} = θ^{[t]} + η (Δ^{[t]} + μ m^{[t]})

    Every step lies in the span of the clients' changes; a direction that persists over rounds grows up to
    η (1 + μ / (1 − μ)) times Δ, one that cancels does not."""

    default_learning_rate = 0.7  # DiLoCo's outer learning rate

    def __init__(self, learning_rate: float = 0.7, momentum: float = 0.9):
        super().__init__(learning_rate)
        if not 0 <= momentum < 1:
            raise ValueError(f"Nesterov momentum (`server_beta1`) must lie in [0, 1), got {momentum}.")
        self.momentum = momentum
        self.m: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, momentum=args.server_beta1)

    def step_block(self, params, delta):
        keys = list(params)
        for key in keys:
            if key not in self.m:
                self.m[key] = torch.zeros_like(delta[key])
        m, d = [self.m[key] for key in keys], [delta[key] for key in keys]
        torch._foreach_mul_(m, self.momentum)
        torch._foreach_add_(m, d)  # m ← μ m + Δ
        look_ahead = torch._foreach_add(d, m, alpha=self.momentum)  # Δ + μ m
        new = torch._foreach_add([params[key].float() for key in keys], look_ahead, alpha=self.learning_rate)
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}

    def block_state(self, keys):
        return {"m": {key: self.m[key] for key in keys}}

    def state_dict(self):
        return {"m": dict(self.m)}

    def load_state_dict(self, state):
        if "m" not in state:
            raise ValueError("Server Nesterov state lacks 'm': it was not saved by a server Nesterov momentum.")
        self.m = {key: tensor.clone() for key, tensor in state["m"].items()}


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
