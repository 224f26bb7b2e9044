"""Moving, checking and sizing PEFT adapter state. Adapters only ever move through PEFT's own
`get_peft_model_state_dict` / `set_peft_model_state_dict`."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

AdapterState = dict[str, torch.Tensor]


def get_adapter_state(model: PeftModel) -> AdapterState:
    """A detached CPU copy of the active adapter (PEFT strips the adapter name from the keys).

    PEFT hands back views of the live parameters; the copy is what lets the model go on training while the
    server holds one client's update.
    """
    return {key: value.detach().to("cpu", copy=True) for key, value in get_peft_model_state_dict(model).items()}


def set_adapter_state(model: PeftModel, state: AdapterState) -> None:
    """Load `state` into the model's active adapter; a key the adapter lacks is an error, not a silent skip."""
    result = set_peft_model_state_dict(model, state)
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
