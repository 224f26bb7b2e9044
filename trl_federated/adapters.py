"""The federation's PEFT adapter: wrapping a model in it, and moving, checking and sizing its state. Adapters only
ever move through PEFT's own `get_peft_model_state_dict` / `set_peft_model_state_dict`."""

from __future__ import annotations

import math
import reprlib
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import (
    LoraConfig,
    PeftConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from transformers import PreTrainedModel, set_seed

from .aggregation.base import is_finite

if TYPE_CHECKING:
    from .aggregation import ClientUpdate

AdapterState = dict[str, torch.Tensor]


class InvalidUpdateError(ValueError):
    """A client's update that the server must not aggregate; the message names the client and the fault."""


def default_lora_config() -> LoraConfig:
    """LoRA on every linear projection of the decoder, as the paper does (it uses r=32, α=128 on 3B+ models)."""
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def with_federated_adapter(model: PreTrainedModel | PeftModel, seed: int, peft_config: PeftConfig | None = None):
    """`model` wrapped in the LoRA adapter the federation trains (`peft_config`, default `default_lora_config`);
    a `PeftModel` is returned as it is.

    LoRA draws its A matrices from the global RNG: it is seeded with `seed` first, as `Trainer` does before
    `model_init`, so that the initial global adapter, and with it the whole run, follows from the seed alone,
    in whichever process (runner, Flower ServerApp) builds it.
    """
    if isinstance(model, PeftModel):
        if peft_config is not None:
            raise ValueError("`model` is already a PeftModel: pass its adapter configuration, not `peft_config`.")
        return model
    set_seed(seed)
    return get_peft_model(model, peft_config or default_lora_config())


def get_adapter_state(model: PeftModel) -> AdapterState:
    """A detached CPU copy of the active adapter (PEFT strips the adapter name from the keys).

    PEFT hands back views of the live parameters; the copy is what lets the model go on training while the
    server holds one client's update.
    """
    return {key: value.detach().to("cpu", copy=True) for key, value in get_peft_model_state_dict(model).items()}


def set_adapter_state(model: PeftModel, state: AdapterState, adapter_name: str = "default") -> None:
    """Load `state` into the model's adapter `adapter_name`; a key the adapter lacks is an error, not a silent
    skip."""
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise KeyError(f"Adapter state has keys the model's adapter lacks: {sorted(result.unexpected_keys)[:5]}")


def state_nbytes(state: AdapterState) -> int:
    """Bytes of tensor data in `state`: what one transfer of it costs on the wire."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def save_adapter(model: PeftModel, state: AdapterState, path: str | Path) -> Path:
    """Write `state` in the standard PEFT layout (`adapter_model.safetensors`, `adapter_config.json`)."""
    set_adapter_state(model, state)
    model.save_pretrained(str(path))
    return Path(path)


def validate_update(
    update: ClientUpdate, global_state: AdapterState, reward_range: tuple[float, float] | None = None
) -> None:
    """Raise `InvalidUpdateError` unless `update` can enter aggregation without corrupting the server.

    The server state (global adapter, Adam moments, RPG baselines, SCAFFOLD control) is a running sum over
    rounds: one NaN, one mis-shaped tensor or one absurd reward would poison every later round. So the adapter
    must have exactly the global adapter's keys, shapes and dtypes and only finite values; a SCAFFOLD
    `control_delta` the same keys and shapes and finite values; D_i must be positive; and R̄ must be a finite
    number inside `reward_range` (the interval the reward functions declare, see
    `rewards.combined_reward_range`), which bounds how far a client can inflate the reward that RPG weighs it by.
    """
    client = update.client_id

    def reject(fault: str):
        raise InvalidUpdateError(f"Update of client {client!r} rejected: {fault}.")

    for name, state, check_dtype in (("adapter", update.state, True), ("control_delta", update.control_delta, False)):
        if state is None:
            continue
        missing, extra = sorted(set(global_state) - set(state)), sorted(set(state) - set(global_state))
        if missing or extra:
            reject(f"{name} keys differ from the global adapter's (missing {missing[:3]}, unexpected {extra[:3]})")
        for key, reference in global_state.items():
            tensor = state[key]
            if not isinstance(tensor, torch.Tensor) or tensor.shape != reference.shape:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                reject(f"{name}[{key!r}] has shape {shape}, expected {tuple(reference.shape)}")
            if check_dtype and tensor.dtype != reference.dtype:
                reject(f"{name}[{key!r}] has dtype {tensor.dtype}, expected {reference.dtype}")
            if not is_finite(tensor):
                reject(f"{name}[{key!r}] holds NaN or Inf")
    if isinstance(update.num_samples, bool) or not isinstance(update.num_samples, int) or update.num_samples < 1:
        reject(f"num_samples must be a positive integer, got {reprlib.repr(update.num_samples)}")
    reward = update.reward
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        reject(f"reward R̄ must be a finite number, got {reprlib.repr(reward)}")
    if reward_range is not None:
        low, high = reward_range
        tolerance = 1e-6 * max(1.0, high - low)  # step rewards are float32 means
        if not low - tolerance <= reward <= high + tolerance:
            reject(f"reward R̄ = {reward} lies outside the reward functions' range [{low}, {high}]")
