"""SCAFFOLD (Karimireddy et al., ICML 2020) over LoRA adapters: the server (Algorithm 1 lines 16-17,
`ScaffoldAggregator`) and the client's corrected local steps (lines 10-13, `ScaffoldCorrection`), in one file."""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from transformers import TrainerCallback

from ..adapters import AdapterState, check_state, non_finite_entries, norm_scale, state_norm, state_size
from ..choices import SCAFFOLD_CORRECTIONS, check_choice
from ..runtime.master_weights import adapter_parameters, linear_term, read_master, write_master
from .base import AggregationError
from .fedavg import FedAvgAggregator
from .server_optim import ServerOptimizer
from .update import ClientHook, ClientUpdate

# How many times the median ‖c_i‖ one client's c_i may count with in c (`ScaffoldAggregator.control_scales`).
CONTROL_MEDIAN_SPREAD = 2.0
# The extras SCAFFOLD exchanges with a client: c and c_i down, Δc_i up.
SERVER_CONTROL, CLIENT_CONTROL, CONTROL_DELTA = "server_control", "client_control", "control_delta"


class ScaffoldAggregator(FedAvgAggregator):
    """FedAvg on the adapters plus control variates, the server's c and every client's c_i, all weighed by data
    volume:

        θ^{[t+1]} = θ^{[t]} + η_g Σ_{i reported} ω_i (θ_i − θ^{[t]})     ω_i = D_i / Σ_{i' reported} D_{i'}
        c_i⁺ = c_i + Δc_i                                                 (for each accepted update)
        c^{[t+1]} = Σ_{i=1}^N p_i c_i                                     p_i = D_i / Σ_{i'=1}^N D_{i'}

    the last sum over all N clients of the federation, c_i = 0 for a client that has not reported yet. A client that
    sits a round out (not sampled, or dropped) keeps its c_i, so c moves by the reporters' changes alone,
    c^{[t+1]} = c^{[t]} + Σ_{i reported} p_i Δc_i: with equal D_i, SCAFFOLD's server update under partial
    participation, c ← c + (|S|/N) · mean_{i∈S} Δc_i (its Algorithm 1, line 17). The server need not know the D_j of
    a client that has never reported: it counts with the mean D of those that have (exact with equal D_i, and once
    every client has reported). SCAFFOLD (Karimireddy et al., ICML 2020) minimises
    the uniform mean of the clients' objectives, so its paper averages both x and c with 1/N; the paper's objective
    F = Σ_i ω_i F_i weighs the clients by data volume, as FedAvg's baseline does, and c estimates ∇F = Σ_i ω_i ∇F_i
    only with the same weights: then Σ_i ω_i (c − c_i) = 0 and the clients' corrections c − c_i cancel in Δ, which
    is what lets SCAFFOLD remove client drift without biasing the global step. (Averaging θ by data volume and c
    by 1/N, as this class did before, leaves Σ_i ω_i (c − c_i) ≠ 0 with unequal D_i, a drift every round adds to.)
    With every client reporting, p_i = ω_i and the identity holds exactly; with equal D_i it is SCAFFOLD's 1/N; with
    sampled clients it holds in expectation over the draw, as in SCAFFOLD.

    The server keeps every c_i and D_i, by client id (`client_controls`, `client_sizes`): it receives every Δc_i
    anyway, so keeping their sum reveals nothing new, survives a client's restart and is checkpointed. Each round a
    client is sent c and its c_i (`client_extras`), trains with the correction c − c_i (`ScaffoldCorrection`, through
    `client_hook`) and sends back Δc_i as its extra "control_delta".

    Args:
        num_clients: N, the federation's size (`from_config` passes it). None: the clients that have reported so far,
            which is N once every client has reported, or from the first round when every client trains each round.
    """

    def __init__(self, server_optimizer: ServerOptimizer | None = None, combiner=None, num_clients: int | None = None):
        super().__init__(server_optimizer, combiner)
        self.num_clients = num_clients
        self.control: AdapterState = {}
        self.client_controls: dict[str, AdapterState] = {}
        self.client_sizes: dict[str, int] = {}

    @classmethod
    def from_config(cls, args, num_clients, server_optimizer, combiner=None) -> ScaffoldAggregator:
        """SCAFFOLD for a federation of `num_clients`: c averages over all of them, sampled or not."""
        return cls(server_optimizer=server_optimizer, combiner=combiner, num_clients=num_clients)

    def server_control(self, global_state: AdapterState) -> AdapterState:
        """c, created as zeros shaped like the adapter on first use."""
        if not self.control:
            self.control = {key: torch.zeros_like(value, dtype=torch.float32) for key, value in global_state.items()}
        return self.control

    def client_control(self, client_id: str, global_state: AdapterState) -> AdapterState:
        """c_i of a client: zeros until its first accepted update."""
        if client_id not in self.client_controls:
            return {key: torch.zeros_like(value) for key, value in self.server_control(global_state).items()}
        return self.client_controls[client_id]

    # Per-client state ----------------------------------------------------------------------------------------

    def client_extras(self, client_id: str, global_state: AdapterState) -> dict[str, AdapterState]:
        return {
            SERVER_CONTROL: self.server_control(global_state),
            CLIENT_CONTROL: self.client_control(client_id, global_state),
        }

    def check_extras(self, update, global_state, norm_bound=None, norm_action="reject") -> None:
        """Δc_i, the only extra, checked like the adapter. `norm_bound` bounds what the server would keep for the
        client, c_i⁺ = c_i + Δc_i, in units of √d (d adapter coordinates): c_i⁺ is the client's mean Adam direction
        (`ScaffoldCorrection`), whose coordinates are about 1 or less. Bounding c_i⁺ rather than each Δc_i bounds
        every c_i over the whole run, and with them c, their weighted mean: no sequence of admitted updates takes
        either past the bound. Over it, the update is refused, or (`norm_action="clip"`) Δc_i is replaced by the one
        that puts c_i⁺ on the bound."""
        if set(update.extras) != {CONTROL_DELTA}:
            names = sorted(map(str, update.extras))[:3]
            raise ValueError(f"SCAFFOLD needs its {CONTROL_DELTA} and nothing else, got {names}")
        delta = update.extras[CONTROL_DELTA]
        check_state(delta, global_state, CONTROL_DELTA)
        if norm_bound is None:
            return
        bound = norm_bound * math.sqrt(state_size(global_state))
        control = self.client_control(update.client_id, global_state)
        kept = {key: control[key] + value.float() for key, value in delta.items()}  # c_i⁺
        scale = norm_scale(state_norm(kept), bound, norm_action, "‖c_i + Δc_i‖", "the control bound",
                           update.client_id)
        if scale != 1.0:
            update.extras[CONTROL_DELTA] = {key: scale * value - control[key] for key, value in kept.items()}

    def correction_norm(self, client_id: str, global_state: AdapterState) -> float:
        """‖c − c_i‖, the decoupled correction each local step applies per unit of learning rate."""
        control = self.client_control(client_id, global_state)
        server_control = self.server_control(global_state)
        return state_norm({key: server_control[key] - control[key] for key in server_control})

    def correction(self, client_id: str, global_state: AdapterState) -> AdapterState:
        """c − c_i, which each decoupled local step applies times its learning rate (`ScaffoldCorrection`)."""
        control = self.client_control(client_id, global_state)
        server_control = self.server_control(global_state)
        return {key: server_control[key] - control[key] for key in server_control}

    def forget(self, client_id: str) -> None:
        """A client the gate refused: its c_i and D_i leave c from this round's aggregation on, so that what it got
        in while admitted stops steering the others' steps; a later admitted update starts it again from c_i = 0."""
        self.client_controls.pop(client_id, None)
        self.client_sizes.pop(client_id, None)

    def accept(self, update: ClientUpdate) -> None:
        # c_i ← c_i⁺ = c_i + Δc_i and D_i, kept only with an accepted update: c is their data-weighted mean.
        delta = update.extras[CONTROL_DELTA]
        control = self.client_control(update.client_id, delta)
        self.client_controls[update.client_id] = {key: control[key] + value for key, value in delta.items()}
        self.client_sizes[update.client_id] = update.num_samples

    @classmethod
    def client_hook(cls, extras: dict[str, AdapterState], args) -> ClientHook | None:
        """SCAFFOLD's local correction with c and c_i (`ScaffoldCorrection`, `args.scaffold_correction`),
        replying Δc_i; None for a train message without controls (a stock Flower strategy's)."""
        if not extras:
            return None
        if set(extras) != {SERVER_CONTROL, CLIENT_CONTROL}:
            raise ValueError(f"SCAFFOLD needs {SERVER_CONTROL} and {CLIENT_CONTROL}, the server sent {sorted(extras)}")
        correction = ScaffoldCorrection(extras[SERVER_CONTROL], extras[CLIENT_CONTROL], args.scaffold_correction)
        return ClientHook(correction, lambda: {CONTROL_DELTA: correction.control_delta})

    # The round -----------------------------------------------------------------------------------------------

    def check_updates(self, global_state, updates: list[ClientUpdate], check_finite: bool = True) -> None:
        super().check_updates(global_state, updates, check_finite)
        missing = [update.client_id for update in updates if CONTROL_DELTA not in update.extras]
        if missing:
            raise ValueError(f"SCAFFOLD updates need `{CONTROL_DELTA}`; missing for clients {missing}.")
        for update in updates:
            name = f"SCAFFOLD: client {update.client_id!r}'s {CONTROL_DELTA}"
            check_state(update.extras[CONTROL_DELTA], global_state, name, check_finite)

    def aggregate(self, global_state, updates: list[ClientUpdate], round_idx: int, check_finite: bool = True):
        new_state = super().aggregate(global_state, updates, round_idx, check_finite)
        keys = list(self.server_control(global_state))
        # c = Σ_{i=1}^N p_i c_i over the clients whose D_i is known (a checkpoint from before `client_sizes` learns
        # each client's at its next report), the others' c_i zero: one fused in-place pass per client into a fresh c.
        # Σ_j D_j counts each client yet to report with the reporters' mean D (see the class docstring); with no c_i
        # kept (updates aggregated without `accept`), c stays 0.
        sizes = {client_id: size for client_id, size in self.client_sizes.items() if client_id in self.client_controls}
        total = sum(sizes.values()) * max(self.num_clients or 0, len(sizes)) / len(sizes) if sizes else 0
        control = torch._foreach_mul([self.control[key] for key in keys], 0.0)
        scales = self.control_scales(list(sizes))
        for client_id, size in sizes.items():
            torch._foreach_add_(control, [self.client_controls[client_id][key] for key in keys],
                                alpha=size / total * scales[client_id])
        self.control = control = dict(zip(keys, control))
        if non_finite := non_finite_entries(control, "server control"):
            raise AggregationError(
                f"Round {round_idx}: SCAFFOLD's {non_finite[0]} is not finite; the round is refused."
            )
        return new_state

    def control_scales(self, client_ids: list[str]) -> dict[str, float]:
        """The factor each client's c_i enters c with: 1, or, for a c_i longer than `CONTROL_MEDIAN_SPREAD` times
        the median ‖c_j‖ of the clients kept (3 or more), the factor that brings it to that length. Honest clients'
        c_i are their mean Adam directions, of like size; one client's c_i, however long the per-client bound lets it
        be, then moves c at most as much as a few honest ones do, in every later round too."""
        norms = {client_id: state_norm(self.client_controls[client_id]) for client_id in client_ids}
        if len(norms) < 3:
            return dict.fromkeys(client_ids, 1.0)
        cap = CONTROL_MEDIAN_SPREAD * statistics.median(norms.values())
        return {client_id: cap / norm if norm > cap else 1.0 for client_id, norm in norms.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "control": dict(self.control),
            "client_controls": {client_id: dict(control) for client_id, control in self.client_controls.items()},
            "client_sizes": dict(self.client_sizes),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.control = {key: tensor.clone() for key, tensor in state["control"].items()}
        self.client_controls = {
            client_id: {key: tensor.clone() for key, tensor in control.items()}
            for client_id, control in state["client_controls"].items()
        }
        self.client_sizes = {client_id: int(size) for client_id, size in state["client_sizes"].items()}


class ScaffoldCorrection(TrainerCallback):
    """The client side of SCAFFOLD (Karimireddy et al., ICML 2020) on the adapter, with a local Adam(W).

    SCAFFOLD corrects every local step by (c − c_i) and afterwards re-estimates the client's control variate with
    option II: c_i⁺ = c_i − c + (θ^{[t]} − θ_i) / (K η). SCAFFOLD was written for SGD; with Adam the two natural
    placements of the correction are:

    - `"decoupled"` (default): after each optimizer step, θ ← θ − η_k (c − c_i), outside Adam's normalisation,
      as AdamW decouples weight decay. Then (θ^{[t]} − θ_i) / Σ_k η_k is the mean Adam direction plus the
      correction, so option II measures c_i in the units the correction is applied in, and c_i⁺ is exactly the
      client's mean Adam direction.
    - `"gradient"`: add (c − c_i) to the gradient before Adam, as in SGD-SCAFFOLD, through the training loss
      (`loss_term`, so once per optimizer step in every engine, and clipped with the GRPO gradient). Adam rescales
      it per coordinate, so a correction estimated in parameter-step units is applied in gradient units; offered
      for comparison.

    θ is the optimizer's float32 values (`master_weights`: DeepSpeed's fp32 copy under bf16), which the decoupled
    correction moves and Δc_i is measured on. K η is taken as Σ_k η_k, the learning rates the steps used (read as
    each step begins: an engine that steps inside `backward` has stepped the scheduler by the step's end). Keys are
    those of `get_peft_model_state_dict`; after training, `control_delta` holds Δc_i = c_i⁺ − c_i.
    """

    def __init__(
        self,
        server_control: dict[str, torch.Tensor],
        client_control: dict[str, torch.Tensor],
        mode: str = "decoupled",
    ):
        check_choice("scaffold_correction", mode, SCAFFOLD_CORRECTIONS)
        self.mode = mode
        self.keys = list(server_control)
        self.correction = [server_control[key] - client_control[key] for key in self.keys]  # c − c_i
        self.server_control = [server_control[key] for key in self.keys]
        self.control_delta: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        parameters = adapter_parameters(model)
        missing = [key for key in self.keys if key not in parameters]
        if missing:
            raise KeyError(f"Control variates have keys the adapter lacks: {missing[:5]}")
        self.params = [parameters[key] for key in self.keys]
        self.anchor = [read_master(param).clone() for param in self.params]
        self.correction = [c.to(anchor.device, anchor.dtype) for c, anchor in zip(self.correction, self.anchor)]
        self.learning_rate_sum = 0.0

    def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        self.learning_rate = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else args.learning_rate

    def loss_term(self) -> torch.Tensor | int:
        return linear_term(self.params, self.correction) if self.mode == "gradient" else 0

    def on_step_end(self, args, state, control, **kwargs):
        # After the optimizer step, whichever engine took it (DeepSpeed steps inside `backward`).
        self.learning_rate_sum += self.learning_rate
        if self.mode == "decoupled":
            for param, correction in zip(self.params, self.correction):
                write_master(param, torch.add(read_master(param), correction, alpha=-self.learning_rate))

    def on_train_end(self, args, state, control, **kwargs):
        if self.learning_rate_sum <= 0:
            raise RuntimeError("SCAFFOLD needs at least one local step with a positive learning rate.")
        with torch.no_grad():
            moved = torch._foreach_sub(self.anchor, [read_master(param) for param in self.params])  # θ^{[t]} − θ_i
            torch._foreach_div_(moved, self.learning_rate_sum)
            delta = torch._foreach_sub(moved, [c.to(m.device) for c, m in zip(self.server_control, moved)])
        self.control_delta = {key: value.to("cpu") for key, value in zip(self.keys, delta)}
