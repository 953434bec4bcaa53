"""Convert the BLIP towers of an ImageReward checkpoint (ImageReward.pt, THUDM/ImageReward) into
transformers' BlipVisionModel and BlipTextModel, so ImageReward runs without the authors' package
(which needs timm, fairscale and torchvision: torchvision cannot be installed beside this
project's torch).

ImageReward.pt is a plain state dict of the authors' `ImageReward` module: `blip.visual_encoder`
(BLIP's timm-style ViT), `blip.text_encoder` (BLIP's "med" BERT with cross-attention), the unused
contrastive projections `blip.vision_proj` / `blip.text_proj`, and the score head `mlp.layers.*`.
The towers compute the same functions as transformers' classes; only names differ:

    blip.visual_encoder.                          BlipVisionModel
        cls_token [1, 1, W]                           embeddings.class_embedding
        pos_embed [1, 1 + patches, W]                 embeddings.position_embedding
        patch_embed.proj.{weight,bias}                embeddings.patch_embedding
        blocks.N.norm1 / blocks.N.norm2               encoder.layers.N.layer_norm1 / layer_norm2
        blocks.N.attn.qkv [3W, W] (q; k; v)           encoder.layers.N.self_attn.qkv (same layout)
        blocks.N.attn.proj                            encoder.layers.N.self_attn.projection
        blocks.N.mlp.fc1 / fc2                        encoder.layers.N.mlp.fc1 / fc2
        norm                                          post_layernorm
    blip.text_encoder.                            BlipTextModel (same names: BLIP's med is the
        embeddings.{word_embeddings,                  model transformers' BlipText was ported
          position_embeddings,LayerNorm}              from), minus the position_ids buffer,
        encoder.layer.N.{attention,crossattention,    which BlipTextModel rebuilds itself
          intermediate,output}.*

Both fuse q, k, v the same way (one Linear, reshaped to [3, heads, head_dim]), so no split is
needed. Sizes are read from the tensors and the med config; the ViT's head count is not in a
state dict and is passed in (BLIP's ViT-L: 16). BLIP's ViT: exact GELU, LayerNorm eps 1e-6, no
pre-norm; its text encoder takes the image tokens through cross-attention of width `encoder_width`
= the ViT width (the authors set it from the ViT, overriding the med config's 768).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from chunk_grpo.rewards.model_files import assign_state_dict

if TYPE_CHECKING:  # imported when used: transformers' models take seconds to import
    from transformers import BlipTextModel, BlipVisionModel

VISION_PREFIX = "blip.visual_encoder."
TEXT_PREFIX = "blip.text_encoder."
HEAD_PREFIX = "mlp."
# Parts of the checkpoint the score does not use: BLIP's image-text contrastive projections, and
# the text position ids buffer (BlipTextModel builds its own).
UNUSED = re.compile(r"^blip\.(vision_proj|text_proj)\.(weight|bias)$"
                    r"|^blip\.text_encoder\.embeddings\.position_ids$")
VIT_LAYER_NORM_EPS = 1e-6  # BLIP's VisionTransformer: partial(nn.LayerNorm, eps=1e-6)

_VISION_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK = {
    "norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}
_VISION_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$")
_TEXT_KEY = re.compile(
    r"^(embeddings\.(word_embeddings|position_embeddings|LayerNorm)"
    r"|encoder\.layer\.\d+\.((attention|crossattention)\.(self\.(query|key|value)"
    r"|output\.(dense|LayerNorm))|intermediate\.dense|output\.(dense|LayerNorm)))"
    r"\.(weight|bias)$")


class BlipConversionError(ValueError):
    """The state dict is not an ImageReward BLIP that transformers' classes can represent."""


def split_image_reward_state_dict(
        state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """(BlipVisionModel state, BlipTextModel state, head state `layers.*`) of an ImageReward state
    dict, renamed as in the module docstring. Keys with no place are an error."""
    if state and all(k.startswith("module.") for k in state):  # saved from DistributedDataParallel
        state = {k[len("module."):]: v for k, v in state.items()}
    vision, text, head, unknown = {}, {}, {}, []
    for key, value in state.items():
        if UNUSED.match(key):
            continue
        if key.startswith(VISION_PREFIX):
            rest = key[len(VISION_PREFIX):]
            if rest in _VISION_TOP:
                vision[_VISION_TOP[rest]] = value
            elif (match := _VISION_BLOCK_KEY.match(rest)) and match.group(2) in _VISION_BLOCK:
                layer, module, kind = match.groups()
                vision[f"encoder.layers.{layer}.{_VISION_BLOCK[module]}.{kind}"] = value
            else:
                unknown.append(key)
        elif key.startswith(TEXT_PREFIX) and _TEXT_KEY.match(key[len(TEXT_PREFIX):]):
            text[key[len(TEXT_PREFIX):]] = value
        elif key.startswith(HEAD_PREFIX):
            head[key[len(HEAD_PREFIX):]] = value
        else:
            unknown.append(key)
    if unknown:
        raise BlipConversionError(f"keys the BLIP classes have no place for (not an ImageReward "
                                  f"checkpoint?): {sorted(unknown)[:6]}")
    return vision, text, head


def _count_layers(state: dict[str, torch.Tensor], pattern: str) -> int:
    found = {int(m.group(1)) for k in state if (m := re.match(pattern, k))}
    if found != set(range(len(found))):
        raise BlipConversionError(f"layers {sorted(found)} are not numbered 0..{len(found) - 1}")
    return len(found)


def vision_model_from_state(vision: dict[str, torch.Tensor], *, heads: int) -> BlipVisionModel:
    """A BlipVisionModel (fp32, eval) holding the converted ViT weights."""
    from transformers import BlipVisionConfig, BlipVisionModel

    try:
        conv = vision["embeddings.patch_embedding.weight"]
        positions = vision["embeddings.position_embedding"].shape[1]
        mlp_width = vision["encoder.layers.0.mlp.fc1.weight"].shape[0]
    except KeyError as err:
        raise BlipConversionError(f"the ViT lacks {err}") from None
    width, patch = conv.shape[0], conv.shape[-1]
    grid = round((positions - 1) ** 0.5)
    if grid * grid != positions - 1:
        raise BlipConversionError(f"pos_embed has {positions} positions: not 1 + a square grid")
    if heads < 1 or width % heads:
        raise BlipConversionError(f"ViT width {width} is not divisible by {heads} heads")
    config = BlipVisionConfig(
        hidden_size=width, intermediate_size=mlp_width, image_size=grid * patch,
        patch_size=patch, num_attention_heads=heads, hidden_act="gelu",
        layer_norm_eps=VIT_LAYER_NORM_EPS, attention_dropout=0.0,
        num_hidden_layers=_count_layers(vision, r"^encoder\.layers\.(\d+)\."))
    return _filled(BlipVisionModel, config, vision)


def text_config_from_med(med: dict, text: dict[str, torch.Tensor]):
    """The BlipTextConfig of the med config `med` (BLIP's BertConfig json), checked against the
    tensors; the cross-attention width is the ViT's, read from the crossattention keys."""
    from transformers import BlipTextConfig

    try:
        vocab, hidden = text["embeddings.word_embeddings.weight"].shape
        max_positions = text["embeddings.position_embeddings.weight"].shape[0]
        encoder_width = text["encoder.layer.0.crossattention.self.key.weight"].shape[1]
        mlp_width = text["encoder.layer.0.intermediate.dense.weight"].shape[0]
    except KeyError as err:
        raise BlipConversionError(f"the text encoder lacks {err}") from None
    layers = _count_layers(text, r"^encoder\.layer\.(\d+)\.")
    checks = {"vocab_size": vocab, "hidden_size": hidden, "max_position_embeddings": max_positions,
              "intermediate_size": mlp_width, "num_hidden_layers": layers}
    wrong = {k: (med.get(k), v) for k, v in checks.items() if med.get(k, v) != v}
    if wrong:
        raise BlipConversionError(f"the med config does not match the checkpoint (config, "
                                  f"weights): {wrong}")
    if not med.get("add_cross_attention", False):
        raise BlipConversionError("the med config has no add_cross_attention: true; ImageReward's "
                                  "text encoder attends to the image")
    heads = int(med.get("num_attention_heads", 12))
    if hidden % heads:
        raise BlipConversionError(f"text width {hidden} is not divisible by {heads} heads")
    return BlipTextConfig(
        vocab_size=vocab, hidden_size=hidden, encoder_hidden_size=encoder_width,
        intermediate_size=mlp_width, num_hidden_layers=layers, num_attention_heads=heads,
        max_position_embeddings=max_positions, hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=int(med.get("pad_token_id", 0)),
        bos_token_id=None, eos_token_id=None, sep_token_id=None,  # no generation here
        is_decoder=True)  # is_decoder builds the crossattention layers; forward passes False


def text_model_from_state(text: dict[str, torch.Tensor], med: dict) -> BlipTextModel:
    """A BlipTextModel (fp32, eval, no pooler) holding the med text encoder's weights."""
    from transformers import BlipTextModel

    config = text_config_from_med(med, text)
    model = _filled(BlipTextModel, config, text, add_pooling_layer=False)
    embeddings = model.embeddings  # non-persistent buffer: rebuild (meta-built)
    embeddings.register_buffer("position_ids", torch.arange(
        config.max_position_embeddings).unsqueeze(0), persistent=False)
    return model


def _filled(cls, config, state: dict[str, torch.Tensor], **kwargs):
    """`cls(config)` built on the meta device and filled by assignment from `state` (a ViT-L is
    not initialised for nothing); every tensor must come from `state`, with its shape."""
    config._attn_implementation = "eager"  # BLIP's own attention code; the same on every device
    with torch.device("meta"):
        model = cls(config, **kwargs)
    assign_state_dict(model, state, BlipConversionError)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_meta and n != "embeddings.position_ids"]
    if left:
        raise BlipConversionError(f"tensors left without a value: {left[:6]}")
    return model.eval()
