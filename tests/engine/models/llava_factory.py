"""A tiny random LLaVA-1.5 checkpoint (CLIP vision tower, projector, Llama language model) written by transformers
with its processor (CLIPImageProcessor, a word-level tokenizer with an ``<image>`` token, a chat template), so that
the engine and the offline API load it as they would ``llava-hf/llava-1.5-7b-hf``."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

IMAGE_TOKEN_ID = 128
IMAGE_SIZE = 32
PATCH_SIZE = 8
# Placeholders per image: the patches, the CLS position dropped ("default" feature select strategy).
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

# llava-hf's template: each message's images as "<image>\n" before its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] if part['type'] == 'image' %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


# LLaVA-NeXT's any-resolution grid: (height, width) an image is resized to before it is cut into 32x32 tiles.
GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96]]


def _configs() -> tuple[CLIPVisionConfig, LlamaConfig]:
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    text = LlamaConfig(vocab_size=136, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return vision, text


def _spread(model: PreTrainedModel, seed: int) -> None:
    """transformers' init gives near-uniform logits that hide errors: spread the weights out."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name or "newline" in name
                                                                 else 0.08) * noise)


def _tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="w1", eos_token="w2", unk_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_llava_next(path: Path, seed: int = 0) -> LlavaNextForConditionalGeneration:
    """A LLaVA-NeXT checkpoint and its processor (any-resolution tiles of the tower's size) at ``path``."""
    vision, text = _configs()
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                             vision_feature_layer=-2, vision_feature_select_strategy="default",
                             image_grid_pinpoints=GRID_PINPOINTS, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    _spread(model, seed)
    model.save_pretrained(path)
    images = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE}, image_grid_pinpoints=GRID_PINPOINTS,
                                     crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    tokenizer = _tokenizer()
    LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                       vision_feature_select_strategy="default", image_token="<image>",
                       num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


def save_tiny_llava(path: Path, seed: int = 0) -> LlavaForConditionalGeneration:
    """Write the checkpoint and its processor to ``path``; return the transformers model (float32, eval)."""
    vision, text = _configs()
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=IMAGE_TOKENS, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _spread(model, seed)
    model.save_pretrained(path)
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                               "width": IMAGE_SIZE})
    tokenizer = _tokenizer()
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                   vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()
