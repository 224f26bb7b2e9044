"""SiLU-gated MLPs with silu(g) and silu(g) * u recomputed in the backward: the same outputs and gradients (the same
kernels on the same values; only a BLAS that depends on its operands' memory alignment could move the last bits),
and two intermediate-size tensors fewer kept per token and layer."""

import ctypes
import ctypes.util
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trl_federated.local.gated_mlp import recomputed_gated_mlp

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def lora_model(architecture, intermediate_size=64, hidden_act="silu"):
    config_class, model_class = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=128, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, hidden_act=hidden_act,
    )  # fmt: skip
    # init_lora_weights=False: a random B, so that every LoRA matrix gets a gradient.
    return get_peft_model(
        model_class(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )


def batch(rows=3, length=12):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 128, (rows, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # left padding
    return input_ids, attention_mask


def logits_and_gradients(model, input_ids, attention_mask, recompute):
    model.zero_grad()
    if recompute:
        with recomputed_gated_mlp(model):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits.log_softmax(-1)[..., :5].sum().backward()  # the backward runs after the context has closed
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_outputs_and_gradients_are_the_standard_ones(architecture):
    model = lora_model(architecture)
    inputs = batch()
    logits, gradients = logits_and_gradients(model, *inputs, recompute=False)
    recomputed_logits, recomputed_gradients = logits_and_gradients(model, *inputs, recompute=True)
    torch.testing.assert_close(recomputed_logits, logits, rtol=1e-6, atol=0)
    assert gradients.keys() == recomputed_gradients.keys() and len(gradients) == 2 * 2 * 7
    for name, gradient in gradients.items():
        assert gradient.norm() > 0, name
        torch.testing.assert_close(recomputed_gradients[name], gradient, rtol=1e-6, atol=1e-12, msg=name)
    assert all("forward" not in vars(module) for module in model.modules())  # the context restored the modules


def test_other_mlps_and_gradient_checkpointing_are_left_alone():
    gelu = lora_model("llama", hidden_act="gelu")
    with recomputed_gated_mlp(gelu):
        assert all("forward" not in vars(module) for module in gelu.modules())
    checkpointed = lora_model("llama")
    checkpointed.activation_checkpointing_enable()
    with recomputed_gated_mlp(checkpointed):
        assert all("forward" not in vars(module) for module in checkpointed.modules())
    silu = lora_model("llama")
    with recomputed_gated_mlp(silu):
        assert sum("forward" in vars(module) for module in silu.modules()) == 2  # one MLP per layer


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def allocated_bytes() -> int:
    """Bytes malloc has handed out and not had back (glibc): heap chunks in use plus mmapped chunks."""
    mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def kept_for_backward(model, input_ids, attention_mask, recompute):
    before = allocated_bytes()
    if recompute:
        with recomputed_gated_mlp(model):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    kept = allocated_bytes() - before
    del logits
    return kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_two_intermediate_tensors_fewer_are_kept():
    torch.set_num_threads(1)  # one malloc arena's worth of noise
    intermediate_size, layers = 1024, 2
    model = lora_model("llama", intermediate_size=intermediate_size)
    input_ids, attention_mask = batch(rows=4, length=128)
    kept_for_backward(model, input_ids, attention_mask, recompute=False)  # warm-up
    standard = kept_for_backward(model, input_ids, attention_mask, recompute=False)
    recomputed = kept_for_backward(model, input_ids, attention_mask, recompute=True)
    two_tensors = 2 * input_ids.numel() * intermediate_size * 4 * layers  # float32
    assert standard - recomputed == pytest.approx(two_tensors, rel=0.05)
