"""Admission of client updates: the one guarded path by which every client reply enters the server.

Whatever the transport (the in-process runner's wire simulation, a Flower reply), a reply is decoded, checked
against what the server itself knows, and bounded before any server state sees it:

1. decoding: the transport's own decoder (`WireFormat.decode`, `flower.records.content_to_update`);
2. identity: the update must speak for the client the server asked (the server's map, not the reply's claim),
   and only once per round;
3. values: `adapters.validate_update` (keys, shapes, dtypes, finite values, sample count, R̄ in `reward_range`);
4. sample count: the server's own count D_i where it has one, else the client's report capped at
   `max_client_samples`;
5. size: ‖θ_i − θ‖ (and SCAFFOLD's ‖Δc_i‖) within `update_norm_bound` (see `update_norm_unit`), else the update
   is rejected or clipped (`update_norm_action`).

Anything that fails, including an exception no check foresaw, is that client's `InvalidUpdateError` with a reason,
never an exception out of the server.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import torch

from .adapters import AdapterState, InvalidUpdateError, validate_update
from .aggregation import ClientUpdate

logger = logging.getLogger(__name__)

NORM_ACTIONS = ("reject", "clip")


def bounded_text(text: str, limit: int = 500) -> str:
    """`text` (chosen by a client: an error message, a reason) cut to `limit` characters for logs and records."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


def update_norm_unit(local_steps: int, learning_rate: float, global_state: AdapterState) -> float:
    """U = E · η · √d, the unit of `update_norm_bound`: the norm of E local steps that each move every one of the
    adapter's d coordinates by the learning rate η.

    An Adam-family optimizer (TRL's default AdamW) moves a coordinate by η·|m̂/√v̂| per step, and |m̂/√v̂| is 1 at
    the first step and about 1 or less after it (Kingma & Ba, 2015, §2.1), so an honest client's ‖θ_i − θ‖ is at
    most about U, whatever the model, the rank or the data; a learning-rate schedule only lowers it. SCAFFOLD's
    decoupled correction adds at most about 2U more (c and c_i are mean Adam directions).
    """
    num_coordinates = sum(tensor.numel() for tensor in global_state.values())
    return local_steps * learning_rate * math.sqrt(num_coordinates)


def state_distance(state: AdapterState, reference: AdapterState) -> float:
    """‖state − reference‖₂ over all entries (keys of `reference`)."""
    return math.sqrt(sum(_norm(state[key].float() - value.float()) ** 2 for key, value in reference.items()))


def state_norm(state: AdapterState) -> float:
    """‖state‖₂ over all entries."""
    return math.sqrt(sum(_norm(value.float()) ** 2 for value in state.values()))


def _norm(tensor: torch.Tensor) -> float:
    """The 2-norm of a float32 tensor, recomputed in float64 where float32 overflows (finite values around 1e20
    and up, a poisoned update's): then it is its true, large value, never Inf."""
    norm = torch.linalg.vector_norm(tensor).item()
    return norm if math.isfinite(norm) else torch.linalg.vector_norm(tensor.double()).item()


class UpdateGate:
    """Decodes, checks and bounds each client's reply before aggregation (see the module docstring).

    Args:
        reward_range: The interval R̄ must lie in (`rewards.combined_reward_range`), or None when not known.
        max_update_norm: Bound on ‖θ_i − θ‖₂ (None: no bound).
        max_control_norm: Bound on SCAFFOLD's ‖Δc_i‖₂ (None: no bound).
        norm_action: "reject" drops an update over a bound; "clip" scales it back onto the bound.
        num_samples: D_i of the clients whose data volume the server knows; it replaces their report.
        max_client_samples: Cap on a self-reported D_i (None: no cap).
        control: Whether updates carry SCAFFOLD's Δc_i (`ClientUpdate.control_delta`): required if so, refused if not.
    """

    def __init__(
        self,
        reward_range: tuple[float, float] | None = None,
        max_update_norm: float | None = None,
        max_control_norm: float | None = None,
        norm_action: str = "reject",
        num_samples: Mapping[str, int] | None = None,
        max_client_samples: int | None = None,
        control: bool = False,
    ):
        if norm_action not in NORM_ACTIONS:
            raise ValueError(f"`norm_action` must be one of {NORM_ACTIONS}, got {norm_action!r}.")
        self.reward_range = reward_range
        self.max_update_norm, self.max_control_norm, self.norm_action = max_update_norm, max_control_norm, norm_action
        self.num_samples = dict(num_samples or {})
        self.max_client_samples = max_client_samples
        self.control = control
        self.global_state: AdapterState = {}
        self.admitted: set[str] = set()

    @classmethod
    def from_config(
        cls,
        args,
        global_state: AdapterState,
        reward_range: tuple[float, float] | None = None,
        num_samples: Mapping[str, int] | None = None,
        control: bool = False,
    ) -> UpdateGate:
        """The gate a `FedGRPOConfig` describes (its "Robustness" fields) for a federation whose global adapter is
        shaped like `global_state`."""
        bound = args.update_norm_bound
        unit = update_norm_unit(args.local_steps, args.learning_rate, global_state)
        # Δc_i is a difference of mean Adam directions, whose coordinates are about 1 or less: its unit is √d.
        control_unit = math.sqrt(sum(tensor.numel() for tensor in global_state.values()))
        return cls(
            reward_range=reward_range,
            max_update_norm=None if bound is None else bound * unit,
            max_control_norm=None if bound is None else bound * control_unit,
            norm_action=args.update_norm_action,
            num_samples=num_samples,
            max_client_samples=args.max_client_samples,
            control=control,
        )

    def open_round(self, global_state: AdapterState) -> None:
        """Start admitting the updates of a round that started from `global_state`."""
        self.global_state = global_state
        self.admitted = set()

    def admit(self, client_id: str, receive: Callable[[], ClientUpdate]) -> ClientUpdate:
        """The update of client `client_id` that `receive()` decodes, checked and bounded; `InvalidUpdateError`
        (naming the client and the fault) for anything else, whatever `receive` raised."""
        try:
            update = receive()
        except InvalidUpdateError:
            raise
        except Exception as error:  # any decoding fault is this client's, not the server's
            raise InvalidUpdateError(
                f"Update of client {client_id!r} rejected: unreadable reply ({type(error).__name__}: "
                f"{bounded_text(error)})."
            ) from error
        try:
            return self._check(client_id, update)
        except InvalidUpdateError:
            raise
        except Exception as error:  # a value no check foresaw: still the client's fault, not a server crash
            raise InvalidUpdateError(
                f"Update of client {client_id!r} rejected: it could not be checked ({type(error).__name__}: "
                f"{bounded_text(error)})."
            ) from error

    def _check(self, client_id: str, update: ClientUpdate) -> ClientUpdate:
        def reject(fault: str):
            raise InvalidUpdateError(f"Update of client {client_id!r} rejected: {fault}.")

        if not isinstance(update, ClientUpdate):
            reject(f"the reply decodes to a {type(update).__name__}, not a ClientUpdate")
        if update.client_id != client_id:
            reject(f"it speaks for client {bounded_text(repr(update.client_id), 100)}")
        if client_id in self.admitted:
            reject("the client already had an update accepted this round")
        if not isinstance(update.state, dict) or not (update.control_delta is None or isinstance(update.control_delta, dict)):
            reject("its adapter and control_delta must be dicts of tensors")
        if self.control != (update.control_delta is not None):
            reject("SCAFFOLD needs its control_delta" if self.control else "it sends a control_delta, but the "
                   "aggregation is not SCAFFOLD")
        if not isinstance(update.metrics, dict) or not all(isinstance(key, str) for key in update.metrics):
            reject("its metrics must be a dict keyed by strings")
        validate_update(update, self.global_state, self.reward_range)
        self._bound_samples(update)
        self._bound_norms(update, reject)
        self.admitted.add(client_id)
        return update

    def _bound_samples(self, update: ClientUpdate) -> None:
        if update.client_id in self.num_samples:
            update.num_samples = self.num_samples[update.client_id]  # the server's count, not the client's
        elif self.max_client_samples is not None and update.num_samples > self.max_client_samples:
            logger.warning(
                "Client %r reports %d training rows; counted as max_client_samples=%d.",
                update.client_id, update.num_samples, self.max_client_samples,
            )
            update.num_samples = self.max_client_samples

    def _bound_norms(self, update: ClientUpdate, reject: Callable[[str], None]) -> None:
        if self.max_update_norm is not None:
            norm = state_distance(update.state, self.global_state)
            if norm > self.max_update_norm:
                if self.norm_action == "reject":
                    reject(f"‖θ_i − θ‖ = {norm:.4g} exceeds update_norm_bound ({self.max_update_norm:.4g})")
                scale = self.max_update_norm / norm
                logger.warning("Client %r: ‖θ_i − θ‖ = %.4g clipped to %.4g.", update.client_id, norm, self.max_update_norm)
                update.state = {
                    key: (reference.double() + scale * (update.state[key].double() - reference.double())).to(reference.dtype)
                    for key, reference in self.global_state.items()
                }
        if self.max_control_norm is not None and update.control_delta is not None:
            norm = state_norm(update.control_delta)
            if norm > self.max_control_norm:
                if self.norm_action == "reject":
                    reject(f"‖Δc_i‖ = {norm:.4g} exceeds the control bound ({self.max_control_norm:.4g})")
                scale = self.max_control_norm / norm
                logger.warning("Client %r: ‖Δc_i‖ = %.4g clipped to %.4g.", update.client_id, norm, self.max_control_norm)
                update.control_delta = {key: value * scale for key, value in update.control_delta.items()}
