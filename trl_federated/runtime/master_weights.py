"""The fp32 values the optimizer steps for a trainable parameter (its "master weights"), whatever the engine.

Plain PyTorch and DDP step the parameter itself, which the federation keeps in float32 (mixed precision casts it
for the forward only). DeepSpeed ZeRO-1/2 (and its bf16 optimizer) steps an fp32 copy of its own and casts the
result into the module's parameter, which under bf16 or fp16 is itself low precision: there the module's value
is rounded (by ~2^-8 of the weight in bf16, more than a round's change at a fine-tuning learning rate) and only
the copy is exact. A client therefore reads the adapter it sends, and loads the global adapter it trains from,
through here; FedProx and SCAFFOLD read and move the same values. The adapter's identity stays PEFT's: its
state-dict keys (`adapter_parameters`).

A trainable parameter that is not float32 and has no fp32 copy (the adapter cast to bf16 without DeepSpeed,
DeepSpeed fp16 without ZeRO) cannot give exact updates: `MasterWeightsError` names it before any step.
"""

from __future__ import annotations

import torch
from peft import get_peft_model_state_dict

from ..adapters import AdapterState


class MasterWeightsError(ValueError):
    """A trainable adapter parameter whose optimizer keeps no float32 values: its updates would not be exact."""


def adapter_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters behind the active adapter's PEFT state-dict entries, by key (PEFT hands back views that share
    storage with them). Call it once the engine is built: DeepSpeed moves parameters into flat buffers."""
    by_storage = {param.data_ptr(): param for param in model.parameters()}
    parameters = {}
    for key, view in get_peft_model_state_dict(model).items():
        if view.data_ptr() not in by_storage:
            raise KeyError(f"The adapter entry {key!r} is not a parameter of the model.")
        parameters[key] = by_storage[view.data_ptr()]
    return parameters


def read_master(param: torch.nn.Parameter) -> torch.Tensor:
    """The float32 values the optimizer steps for `param` (detached; on every process, where DeepSpeed gathers
    them, so every process must call it). A frozen parameter is read as it is."""
    if _has_deepspeed_master(param):
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(param).detach()
    _require_float32(param)
    return param.detach()


def write_master(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the values the optimizer steps for `param` to `value`, and the module's parameter to `value` in its own
    dtype (what the forward sees); every process must call it with the same value."""
    with torch.no_grad():
        if _has_deepspeed_master(param):
            from deepspeed.utils import safe_set_full_fp32_param

            safe_set_full_fp32_param(param, value.to(param.device, torch.float32))
        else:
            _require_float32(param)
        param.copy_(value)


def read_master_state(model) -> AdapterState:
    """A detached float32 CPU copy of the active adapter's master values, keyed like `get_peft_model_state_dict`:
    what a client sends."""
    return {key: read_master(param).to("cpu", copy=True) for key, param in adapter_parameters(model).items()}


def write_master_state(model, state: AdapterState) -> None:
    """Load `state` (keyed like `get_peft_model_state_dict`) into the active adapter's master values and
    parameters; a key the adapter lacks is an error."""
    parameters = adapter_parameters(model)
    if unexpected := sorted(set(state) - set(parameters)):
        raise KeyError(f"Adapter state has keys the model's adapter lacks: {unexpected[:5]}")
    for key, value in state.items():
        write_master(parameters[key], value)


def linear_term(params: list[torch.Tensor], gradient: list[torch.Tensor]) -> torch.Tensor:
    """A loss term whose value is 0 and whose gradient with respect to `params` is `gradient` (cast to each
    parameter's dtype): Σ ⟨g, θ − stopgrad(θ)⟩. Added to the training loss, it adds `gradient` to every engine's
    gradient with the loss's own scaling, and leaves the logged loss as it is: how FedProx's pull
    (`local_trainer.ProximalTerm`) and SCAFFOLD's gradient correction (`aggregation.scaffold`) reach the step."""
    return sum(
        ((param - param.detach()) * grad.to(param.device, param.dtype)).sum() for param, grad in zip(params, gradient)
    )


def check_float32_adapter(model) -> None:
    """Refuse a model whose trainable adapter parameters are not float32 before a federation starts: the global
    adapter is float32, and no engine's optimizer would keep exact values for them (DeepSpeed's fp32 copy would
    start from the rounded values)."""
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            raise MasterWeightsError(
                f"The trainable adapter parameter {name!r} is {param.dtype}: the federation trains and exchanges a "
                "float32 adapter. Keep the adapter in float32 (PEFT's default, `autocast_adapter_dtype=True`) and "
                "train in mixed precision (`bf16=True`, or DeepSpeed ZeRO-1/2 with bf16), which casts for compute."
            )


def _has_deepspeed_master(param: torch.nn.Parameter) -> bool:
    # DeepSpeed's own test (`safe_get_full_fp32_param`): ZeRO-1/2 and its bf16 optimizer link every parameter they
    # step to its fp32 fragment; ZeRO-3 parameters (`ds_id`) are refused earlier (`distributed`).
    return hasattr(param, "_hp_mapping")


def _require_float32(param: torch.nn.Parameter) -> None:
    if param.requires_grad and param.dtype != torch.float32:
        raise MasterWeightsError(
            f"A trainable adapter parameter is {param.dtype} and the engine keeps no float32 copy of it (plain "
            "PyTorch or DDP on a low-precision adapter, or DeepSpeed fp16 without ZeRO), so its update cannot be "
            "sent exactly. Keep the adapter in float32 with mixed precision, or use DeepSpeed ZeRO-1/2."
        )
