"""Tiny, fully offline model and tokenizer for tests, notebooks and benchmarks.

A real Qwen2 architecture with random weights and a byte-level BPE tokenizer trained here with `tokenizers`,
so that the whole TRL/PEFT stack runs for real in about a second per GRPO step, without the Hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "What is 12 + 7? Think step by step and give the answer inside <answer></answer>.",
    "<answer>19</answer> The sum of the numbers is nineteen.",
    "Solve: 3 * 4 - 5 = ? The result is 7. Count the letters in the word banana.",
    "user assistant system You are a helpful assistant that reasons before answering.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) , . ?",
]


def build_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a ChatML template, trained in milliseconds on a built-in corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, hidden_size: int = 32, num_layers: int = 2, seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised 2-layer Qwen2 whose vocabulary matches `tokenizer`."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path: str | Path, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny model and its tokenizer to `path` so that `from_pretrained(path)` loads both offline."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
