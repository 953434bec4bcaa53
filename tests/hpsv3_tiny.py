"""A tiny random HPSv3 (Qwen2-VL + the authors' head) saved in the authors' checkpoint layout.

What a user downloads, in miniature: HPSv3.safetensors with the flat transformers-4.45 key names
(`visual.*`, `model.*`, `lm_head.*`, `rm_head.{0,3,5}.*`) and an embedding resized to the
tokenizer + <|Reward|>, next to Qwen2-VL-style config.json (flat, padded vocab_size),
preprocessor_config.json and tokenizer files (which do not contain <|Reward|>). Used by
tests/unit/rewards/test_rewards_hpsv3.py and benchmarks/bench_reward_hpsv3.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import Qwen2TokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from chunk_grpo.rewards.hpsv3 import INSTRUCTION

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
            "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
            "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL-7B-Instruct's published chat template.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PUBLISHED_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
}
PROMPTS = ["a red circle", "two blue squares on the left", "a cat"]


def tiny_tokenizer() -> Qwen2TokenizerFast:
    """A byte-level BPE trained offline on the instruction, with Qwen2-VL's special tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([INSTRUCTION] + PROMPTS, trainer)
    tokenizer = Qwen2TokenizerFast(tokenizer_object=bpe, additional_special_tokens=SPECIALS[1:],
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None)
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    return tokenizer


def _flat_config(tokenizer) -> dict:
    """Qwen2-VL-7B-Instruct's config.json layout (transformers 4.45: text keys at the top),
    with tiny sizes; vocab_size is padded above the tokenizer as the published one is."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
        "vocab_size": len(tokenizer) + 64, "tie_word_embeddings": False,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "torch_dtype": "bfloat16",
        "vision_config": {"depth": 1, "embed_dim": 16, "mlp_ratio": 2, "num_heads": 2,
                          "in_chans": 3, "hidden_size": 32, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "temporal_patch_size": 2},
    }


def authors_state_dict(model: Qwen2VLForConditionalGeneration, head: nn.Sequential) -> dict:
    """transformers-5 names -> the flat names of the authors' checkpoint (written by hand here,
    independently of the loader's mapping)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.visual."):
            key = key[len("model."):]
        elif key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        out[key] = value.clone().contiguous()
    out.update({f"rm_head.{k}": v.clone() for k, v in head.state_dict().items()})
    return out


def save_tiny_hpsv3(root: Path, seed: int = 0):
    """Write the tiny model to `root`; returns (model, head, tokenizer) kept in memory."""
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(root)
    (root / "config.json").write_text(json.dumps(_flat_config(tokenizer)))
    (root / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_PREPROCESSOR))
    config = Qwen2VLConfig.from_pretrained(root)
    config.text_config.vocab_size = len(tokenizer) + 1  # the authors' resize, + <|Reward|>
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).float().eval()
    head = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16),
                         nn.ReLU(), nn.Linear(16, 2)).eval()
    save_file(authors_state_dict(model, head), str(root / "HPSv3.safetensors"))
    return model, head, tokenizer
