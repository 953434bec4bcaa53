"""Tiny random reward models of the real architectures, saved the way the real ones are shipped
(CLIPModel directories with a CLIP BPE tokenizer and preprocessor_config.json, an aesthetic head
.pth, an open_clip-format checkpoint), for the reward tests and the reward benchmark."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPModel

from chunk_grpo.models.tiny import build_clip_tokenizer
from chunk_grpo.rewards.aesthetic import AESTHETIC_HEAD, AestheticHead
from chunk_grpo.shapes import VOCABULARY

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
# openai/clip-vit-large-patch14's preprocessor_config.json (the legacy layout: int sizes).
OPENAI_PROCESSOR_CONFIG = {
    "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": OPENAI_MEAN,
    "image_std": OPENAI_STD, "resample": 3, "size": 224,
}


def processor_config(image_size: int, mean=OPENAI_MEAN, std=OPENAI_STD) -> dict:
    """A CLIPImageProcessor config in today's layout (dict sizes), as save_pretrained writes it."""
    return {
        "crop_size": {"height": image_size, "width": image_size}, "do_center_crop": True,
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": list(mean), "image_processor_type": "CLIPImageProcessor",
        "image_std": list(std), "resample": 3, "rescale_factor": 1 / 255,
        "size": {"shortest_edge": image_size},
    }


def tiny_clip_model(*, image_size: int = 32, patch_size: int = 8, seed: int = 0,
                    hidden_act: str = "quick_gelu", projection_dim: int = 16) -> CLIPModel:
    """A random CLIPModel of widths 32, two layers per tower, for the shapes-world tokenizer."""
    tokenizer = build_clip_tokenizer(VOCABULARY)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                         hidden_act=hidden_act, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=image_size, patch_size=patch_size,
                           hidden_act=hidden_act),
        projection_dim=projection_dim,
    )
    model = CLIPModel(config).eval()
    with torch.no_grad():  # a logit scale other than the init value, so the scale is tested
        model.logit_scale.fill_(3.0)
    return model


def save_tiny_clip(path: Path, *, image_size: int = 32, patch_size: int = 8, seed: int = 0,
                   mean=OPENAI_MEAN, std=OPENAI_STD, hidden_act: str = "quick_gelu",
                   projection_dim: int = 16) -> Path:
    """A CLIPModel directory: weights, CLIP BPE tokenizer, preprocessor_config.json."""
    model = tiny_clip_model(image_size=image_size, patch_size=patch_size, seed=seed,
                            hidden_act=hidden_act, projection_dim=projection_dim)
    model.save_pretrained(path)
    save_processor(path, image_size, mean, std)
    return path


def save_processor(path: Path, image_size: int, mean=OPENAI_MEAN, std=OPENAI_STD) -> Path:
    """A processor-only directory (tokenizer + preprocessor config), like the laion ViT-H-14 one
    PickScore and HPSv2 take their processor from."""
    path.mkdir(parents=True, exist_ok=True)
    build_clip_tokenizer(VOCABULARY).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps(processor_config(image_size, mean, std), indent=2))
    return path


def save_aesthetic_head(path: Path, input_size: int, seed: int = 0) -> Path:
    """A random head of the published layer sizes, saved as a plain state dict .pth."""
    torch.manual_seed(seed)
    head = AestheticHead(input_size)
    target = path / AESTHETIC_HEAD if path.is_dir() else path
    torch.save(head.state_dict(), target)
    return target


def open_clip_state_dict(model: CLIPModel) -> dict[str, torch.Tensor]:
    """The open_clip CLIP state dict holding `model`'s weights: the inverse of the converter,
    written separately from it (open_clip's names from its VisionTransformer/TextTransformer)."""
    hf = model.state_dict()
    out = {
        "visual.conv1.weight": hf["vision_model.embeddings.patch_embedding.weight"],
        "visual.class_embedding": hf["vision_model.embeddings.class_embedding"],
        "visual.positional_embedding": hf["vision_model.embeddings.position_embedding.weight"],
        "visual.ln_pre.weight": hf["vision_model.pre_layrnorm.weight"],
        "visual.ln_pre.bias": hf["vision_model.pre_layrnorm.bias"],
        "visual.ln_post.weight": hf["vision_model.post_layernorm.weight"],
        "visual.ln_post.bias": hf["vision_model.post_layernorm.bias"],
        "visual.proj": hf["visual_projection.weight"].T,
        "token_embedding.weight": hf["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": hf["text_model.embeddings.position_embedding.weight"],
        "ln_final.weight": hf["text_model.final_layer_norm.weight"],
        "ln_final.bias": hf["text_model.final_layer_norm.bias"],
        "text_projection": hf["text_projection.weight"].T,
        "logit_scale": hf["logit_scale"],
    }
    names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
             "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    pattern = re.compile(r"(vision|text)_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    for key in hf:
        match = pattern.match(key)
        if not match:
            continue
        tower, layer, module, kind = match.groups()
        prefix = f"{'visual.' if tower == 'vision' else ''}transformer.resblocks.{layer}."
        if module.startswith("self_attn.") and module[-6:] in ("q_proj", "k_proj", "v_proj"):
            if module.endswith("q_proj"):  # q, k, v stacked in one in_proj, in that order
                base = f"{tower}_model.encoder.layers.{layer}.self_attn."
                out[f"{prefix}attn.in_proj_{kind}"] = torch.cat(
                    [hf[f"{base}{p}_proj.{kind}"] for p in "qkv"], dim=0)
        else:
            out[f"{prefix}{names[module]}.{kind}"] = hf[key]
    return {k: v.clone() for k, v in out.items()}
