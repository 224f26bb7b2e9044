"""Tiny, fully offline models, tokenizer and processor for tests, notebooks and benchmarks.

A real Qwen2 architecture with random weights and a byte-level BPE tokenizer trained here with `tokenizers`,
so that the whole TRL/PEFT stack runs for real in about a second per GRPO step, without the Hub. The tiny
vision-language model puts a small CLIP vision tower in front of the same Qwen2 decoder (the LLaVA layout) with
a `LlavaProcessor`: unlike Qwen2-VL's processor, it needs no torchvision, so it runs wherever the text model does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A ChatML template that also renders TRL's multimodal content parts, an image part as the image token.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IMAGE_TOKEN = "<image>"
_CORPUS = [
    "What is 12 + 7? Think step by step and give the answer inside <answer></answer>.",
    "<answer>19</answer> The sum of the numbers is nineteen.",
    "Solve: 3 * 4 - 5 = ? The result is 7. Count the letters in the word banana.",
    "user assistant system You are a helpful assistant that reasons before answering.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) , . ?",
]


def build_tiny_tokenizer(vocab_size: int = 512, with_image_token: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a ChatML template, trained in milliseconds on a built-in corpus.

    With `with_image_token`, it also has the special token `<image>` and a template that renders image parts.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + ([IMAGE_TOKEN] if with_image_token else []),
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
    fast.chat_template = VLM_CHAT_TEMPLATE if with_image_token else CHAT_TEMPLATE
    return fast


def _tiny_text_config(tokenizer: PreTrainedTokenizerFast, hidden_size: int, num_layers: int) -> Qwen2Config:
    return Qwen2Config(
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


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, hidden_size: int = 32, num_layers: int = 2, seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised 2-layer Qwen2 whose vocabulary matches `tokenizer`."""
    config = _tiny_text_config(tokenizer, hidden_size, num_layers)
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


def build_tiny_processor(image_size: int = 28, patch_size: int = 14) -> LlavaProcessor:
    """A `LlavaProcessor`: the tiny tokenizer with `<image>`, and a PIL CLIP image processor that resizes every
    image to `image_size` pixels square, so an image costs (image_size / patch_size)² tokens (4 by default)."""
    tokenizer = build_tiny_tokenizer(with_image_token=True)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",  # drop CLIP's class token: one image token per patch
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=VLM_CHAT_TEMPLATE,
    )


def build_tiny_vlm(
    processor: LlavaProcessor, hidden_size: int = 32, num_layers: int = 2, seed: int = 0
) -> LlavaForConditionalGeneration:
    """A randomly initialised vision-language model matching `processor`: a 1-layer CLIP vision tower (width 16),
    a 2-layer MLP projector and the tiny Qwen2 decoder."""
    tokenizer = processor.tokenizer
    image_size = processor.image_processor.crop_size["height"]
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            image_size=image_size, patch_size=processor.patch_size,
        ),  # fmt: skip
        text_config=_tiny_text_config(tokenizer, hidden_size, num_layers),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_vlm(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny vision-language model and its processor to `path`, so that
    `AutoModelForImageTextToText.from_pretrained(path)` and `AutoProcessor.from_pretrained(path)` load them offline."""
    path = Path(path)
    processor = build_tiny_processor()
    build_tiny_vlm(processor, seed=seed).save_pretrained(path)
    processor.save_pretrained(path)
    return path
