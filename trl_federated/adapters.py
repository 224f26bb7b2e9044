"""The tensor layer: the federation's PEFT adapter and the arithmetic on its state, at the bottom of the package.

Wrapping a model in the adapter, moving its state in and out (only ever through PEFT's own
`get_peft_model_state_dict` / `set_peft_model_state_dict`) and writing it; `AdapterState` and the arithmetic on it
(sizes, norms, distances, finiteness, the key-and-shape check); and which of its entries are LoRA A (`is_lora_a`),
which the wire (`wire.WireFormat`) may leave unsent. Everything above imports these from here: nothing low imports
the aggregation package."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from peft import (
    LoraConfig,
    PeftConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from safetensors.torch import save_file
from transformers import PreTrainedModel, set_seed

logger = logging.getLogger(__name__)

AdapterState = dict[str, torch.Tensor]
"""An adapter's tensors, keyed as `peft.get_peft_model_state_dict` keys them (or a state shaped like one)."""


# PEFT's adapter folder layout (what `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained` reads).
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


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


def save_adapter(model: PeftModel, state: AdapterState, path: str | Path) -> Path:
    """Load `state` into `model` and write it in the standard PEFT layout (`write_adapter`)."""
    set_adapter_state(model, state)
    return write_adapter(state, model.peft_config[model.active_adapter], path)


def write_adapter(state: AdapterState, adapter_config: PeftConfig, path: str | Path) -> Path:
    """Write `state` as a PEFT adapter folder (`adapter_model.safetensors`, `adapter_config.json`), its values as they
    are: `PeftModel.save_pretrained` would write the module's, which an engine such as DeepSpeed bf16 keeps rounded."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in state.items()}
    save_file(tensors, path / ADAPTER_FILE, metadata={"format": "pt"})
    adapter_config.save_pretrained(str(path))
    return path


# State arithmetic: sizes, norms, distances, finiteness ----------------------------------------------------------


def state_nbytes(state: AdapterState) -> int:
    """Bytes of tensor data in `state`: what one transfer of it costs on the wire."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def check_state(
    state: Any, reference: dict[str, torch.Tensor], name: str, check_finite: bool = True, same_dtype: bool = False
) -> None:
    """Raise `ValueError` unless `state` has exactly `reference`'s keys and shapes and floating-point values (with
    `same_dtype`, `reference`'s dtypes), finite (unless `check_finite=False`)."""
    if not isinstance(state, dict) or set(state) != set(reference):
        keys = set(state) if isinstance(state, dict) else set()
        raise ValueError(f"{name} must have the global adapter's keys (missing {sorted(set(reference) - keys)[:3]}, "
                         f"unexpected {sorted(map(str, keys - set(reference)))[:3]}).")
    for key, expected in reference.items():
        tensor = state[key]
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.shape != expected.shape
            or not (tensor.dtype == expected.dtype if same_dtype else tensor.is_floating_point())
        ):
            described = (
                f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            dtype = expected.dtype if same_dtype else "floating point"
            raise ValueError(f"{name}[{key!r}] is {described}, expected {dtype} {tuple(expected.shape)}.")
        if check_finite and not is_finite(tensor):
            raise ValueError(f"{name}[{key!r}] holds NaN or Inf.")


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite, in one pass that allocates nothing: NaN propagates into the minimum
    and maximum, and ±Inf shows there (7x faster than `torch.isfinite(tensor).all()` on an adapter)."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    if tensor.is_complex():
        return bool(torch.isfinite(tensor).all())
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def non_finite_entries(tree: Any, name: str) -> list[str]:
    """The paths in `tree` (nested dicts of tensors and numbers) of the tensors and floats that are not finite."""
    if isinstance(tree, torch.Tensor):
        return [] if is_finite(tree) else [name]
    if isinstance(tree, float):
        return [] if math.isfinite(tree) else [name]
    if isinstance(tree, dict):
        return [path for key, value in tree.items() for path in non_finite_entries(value, f"{name}[{key!r}]")]
    return []


def state_distance(state: AdapterState, reference: AdapterState) -> float:
    """‖state − reference‖₂ over all entries (keys of `reference`)."""
    return math.sqrt(sum(tensor_norm(state[key].float() - value.float()) ** 2 for key, value in reference.items()))


def state_size(state: AdapterState) -> int:
    """d, the number of coordinates of `state`: the dimension that norm bounds and DP's noise scale with (√d)."""
    return sum(tensor.numel() for tensor in state.values())


def state_norm(state: AdapterState) -> float:
    """‖state‖₂ over all entries."""
    return math.sqrt(sum(tensor_norm(value.float()) ** 2 for value in state.values()))


def scaled_update(state: AdapterState, reference: AdapterState, scale: float) -> AdapterState:
    """The adapter θ + scale · (state − θ), θ = `reference`, in `reference`'s dtypes (computed in float64): a client's
    update scaled, as bounding or clipping its norm scales it."""
    return {
        key: (value.double() + scale * (state[key].double() - value.double())).to(value.dtype)
        for key, value in reference.items()
    }


def norm_scale(norm: float, bound: float, norm_action: str, measured: str, bound_name: str, client_id: str) -> float:
    """The factor that brings a client's `measured` quantity (its norm `norm`) within `bound`: 1 when it is within;
    over it, `ValueError` naming both with `norm_action="reject"`, else (`"clip"`) `bound / norm`, logged."""
    if norm <= bound:
        return 1.0
    if norm_action == "reject":
        raise ValueError(f"{measured} = {norm:.4g} exceeds {bound_name} ({bound:.4g})")
    logger.warning("Client %r: %s = %.4g clipped to %.4g.", client_id, measured, norm, bound)
    return bound / norm


def tensor_norm(tensor: torch.Tensor) -> float:
    """The 2-norm of a float32 tensor, recomputed in float64 where float32 overflows (finite values around 1e20
    and up, a poisoned update's): then it is its true, large value, never Inf."""
    norm = torch.linalg.vector_norm(tensor).item()
    return norm if math.isfinite(norm) else torch.linalg.vector_norm(tensor.double()).item()


def is_lora_a(key: str) -> bool:
    """Whether a PEFT state-dict key is a LoRA A factor (`...lora_A.weight`, `...lora_embedding_A`)."""
    return ".lora_A." in key or "lora_embedding_A" in key


def freeze_lora_a(model) -> None:
    """FFA-LoRA (`lora_aggregation="freeze_a"`): the A factors keep their seeded initialisation, the same on the
    server and every client; only B trains, and only B travels."""
    for name, param in model.named_parameters():
        if is_lora_a(name):
            param.requires_grad_(False)
