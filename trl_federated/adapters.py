"""The federation's PEFT adapter: wrapping a model in it, and moving and sizing its state. Adapters only
ever move through PEFT's own `get_peft_model_state_dict` / `set_peft_model_state_dict`."""

from __future__ import annotations

from pathlib import Path

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

from .aggregation.base import AdapterState

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


def state_nbytes(state: AdapterState) -> int:
    """Bytes of tensor data in `state`: what one transfer of it costs on the wire."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


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
