"""A tiny random Qwen2-VL checkpoint (its vision transformer, patch merger and Qwen2 language model with M-RoPE)
written by transformers with its image processor (``Qwen2VLImageProcessor`` with small min/max pixels) and a
word-level tokenizer holding Qwen2-VL's vision special tokens and a chat template, so that the engine and the
offline API load it as they would ``Qwen/Qwen2-VL-2B-Instruct``."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
)

from tests.engine.models.llava_factory import _spread

WORDS = 128
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = WORDS, WORDS + 1, WORDS + 2, WORDS + 3
PATCH_SIZE = 14
MERGE_SIZE = 2
# Dynamic resolution bounded to a few merged patches: 56x56 -> 4x4 patches -> 4 placeholders.
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112

# Qwen2-VL's template, shortened: each image part as <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>",
                "<|im_end|>"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="w2", unk_token="w0", pad_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def qwen2_vl_config() -> Qwen2VLConfig:
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, in_channels=3)
    # head_dim 16: mrope_section [2, 3, 3] covers its 8 frequencies
    text = dict(vocab_size=WORDS + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                         video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
                         vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)


def save_tiny_qwen2_vl(path: Path, seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """Write the checkpoint and its processor to ``path``; return the transformers model (float32, eval)."""
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(qwen2_vl_config())
    _spread(model, seed)
    model.save_pretrained(path)
    images = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                                   merge_size=MERGE_SIZE, temporal_patch_size=2)
    # Qwen2VLProcessor itself needs torchvision (its video processor): the image processor and the tokenizer
    # (with the chat template) are saved as the hub's checkpoints hold them, and Sluice reads them apart.
    images.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return model.eval()
