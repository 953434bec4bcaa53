"""Convert an open_clip CLIP state dict (ViT image tower, text transformer) into transformers'
CLIPModel, so open_clip checkpoints such as HPSv2.1 run without open_clip (which needs
torchvision, which cannot be installed beside this project's torch).

The two implementations compute the same functions; only names and layouts differ:

    open_clip                                      CLIPModel
    visual.conv1.weight                            vision_model.embeddings.patch_embedding.weight
    visual.class_embedding                         vision_model.embeddings.class_embedding
    visual.positional_embedding                    vision_model.embeddings.position_embedding.weight
    visual.ln_pre / visual.ln_post                 vision_model.pre_layrnorm / .post_layernorm
    visual.proj  [width, embed]                    visual_projection.weight  [embed, width] (.T)
    token_embedding.weight                         text_model.embeddings.token_embedding.weight
    positional_embedding                           text_model.embeddings.position_embedding.weight
    ln_final                                       text_model.final_layer_norm
    text_projection  [width, embed]                text_projection.weight  [embed, width] (.T)
    logit_scale                                    logit_scale
    {visual.}transformer.resblocks.N.              {vision,text}_model.encoder.layers.N.
        ln_1 / ln_2                                    layer_norm1 / layer_norm2
        attn.in_proj_weight [3W, W] (q; k; v)          self_attn.{q,k,v}_proj.weight (split in 3)
        attn.in_proj_bias [3W]                         self_attn.{q,k,v}_proj.bias
        attn.out_proj                                  self_attn.out_proj
        mlp.c_fc / mlp.c_proj                          mlp.fc1 / mlp.fc2

Sizes are read from the tensors; the attention head counts are not in a state dict and are
passed in (ViT-H-14: 16 and 16). Activation: exact GELU (open_clip's default for ViT-H-14; OpenAI's
own checkpoints use QuickGELU: `quick_gelu=True`). Text pooling: open_clip takes the token of the
largest id (the end token in CLIP's BPE), CLIPModel the first end token: the same position.
Checkpoints with parts CLIPModel lacks (layer scale, attentional pooling, ...) are refused.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from chunk_grpo.rewards.model_files import assign_state_dict

if TYPE_CHECKING:  # imported when used: transformers' models take seconds to import
    from transformers import CLIPConfig, CLIPModel

_TOP_LEVEL = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual.proj": "visual_projection.weight",
               "text_projection": "text_projection.weight"}
_BLOCK = {
    "ln_1.weight": "layer_norm1.weight", "ln_1.bias": "layer_norm1.bias",
    "ln_2.weight": "layer_norm2.weight", "ln_2.bias": "layer_norm2.bias",
    "attn.out_proj.weight": "self_attn.out_proj.weight",
    "attn.out_proj.bias": "self_attn.out_proj.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
}
_BLOCK_KEY = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")


class OpenClipConversionError(ValueError):
    """The state dict is not an open_clip ViT CLIP that CLIPModel can represent."""


def convert_open_clip_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIPModel state dict from an open_clip one (see the module docstring for the mapping)."""
    if state and all(k.startswith("module.") for k in state):  # saved from DistributedDataParallel
        state = {k[len("module."):]: v for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state.items():
        if key == "attn_mask":  # the text tower's causal mask buffer; CLIPModel builds its own
            continue
        if key in _TOP_LEVEL:
            out[_TOP_LEVEL[key]] = value
        elif key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.t().contiguous()
        elif match := _BLOCK_KEY.match(key):
            tower = "vision_model" if match.group(1) else "text_model"
            prefix = f"{tower}.encoder.layers.{match.group(2)}."
            rest = match.group(3)
            if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = "weight" if rest.endswith("weight") else "bias"
                for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
                    out[f"{prefix}self_attn.{name}_proj.{kind}"] = part.contiguous()
            elif rest in _BLOCK:
                out[prefix + _BLOCK[rest]] = value
            else:
                unknown.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise OpenClipConversionError(f"keys CLIPModel has no place for (not a plain open_clip "
                                      f"ViT CLIP): {sorted(unknown)[:6]}")
    return out


def _count_layers(state: dict[str, torch.Tensor], prefix: str) -> int:
    indices = {int(m.group(2)) for k in state if (m := _BLOCK_KEY.match(k))
               and bool(m.group(1)) == (prefix == "visual.")}
    return max(indices) + 1 if indices else 0


def clip_config_from_open_clip(state: dict[str, torch.Tensor], *, vision_heads: int,
                               text_heads: int, bos_token_id: int, eos_token_id: int,
                               pad_token_id: int, quick_gelu: bool = False) -> CLIPConfig:
    """The CLIPConfig whose model has exactly the shapes of the open_clip state dict."""
    from transformers import CLIPConfig

    try:
        conv = state["visual.conv1.weight"]
        vision_width, patch = conv.shape[0], conv.shape[-1]
        grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        vocab, text_width = state["token_embedding.weight"].shape
        embed = state["text_projection"].shape[1]
        vision_mlp = state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
        text_mlp = state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
        context = state["positional_embedding"].shape[0]
        logit_scale = float(state["logit_scale"])
    except KeyError as err:
        raise OpenClipConversionError(f"not an open_clip ViT CLIP state dict: no {err}") from None
    if state["visual.proj"].shape[1] != embed:
        raise OpenClipConversionError("visual.proj and text_projection have different widths")
    for width, heads, tower in ((vision_width, vision_heads, "vision"),
                                (text_width, text_heads, "text")):
        if heads < 1 or width % heads:
            raise OpenClipConversionError(f"{tower} width {width} is not divisible by "
                                          f"{heads} heads")
    act = "quick_gelu" if quick_gelu else "gelu"
    return CLIPConfig(
        text_config=dict(vocab_size=vocab, hidden_size=text_width, intermediate_size=text_mlp,
                         num_hidden_layers=_count_layers(state, ""),
                         num_attention_heads=text_heads, max_position_embeddings=context,
                         hidden_act=act, layer_norm_eps=1e-5, projection_dim=embed,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id),
        vision_config=dict(hidden_size=vision_width, intermediate_size=vision_mlp,
                           num_hidden_layers=_count_layers(state, "visual."),
                           num_attention_heads=vision_heads, image_size=patch * grid,
                           patch_size=patch, hidden_act=act, layer_norm_eps=1e-5,
                           projection_dim=embed),
        projection_dim=embed,
        logit_scale_init_value=logit_scale,
    )


def clip_model_from_open_clip(state: dict[str, torch.Tensor], **config_kwargs) -> CLIPModel:
    """A CLIPModel (fp32, eval) holding the open_clip weights; `config_kwargs` as for
    `clip_config_from_open_clip`. Every CLIPModel weight must come from the state dict."""
    from transformers import CLIPModel

    config = clip_config_from_open_clip(state, **config_kwargs)
    converted = convert_open_clip_state_dict(state)
    with torch.device("meta"):
        model = CLIPModel(config)
    # Built on the meta device and filled by assignment: a ViT-H is not initialised for nothing.
    assign_state_dict(model, converted, OpenClipConversionError)
    for tower in (model.vision_model, model.text_model):  # non-persistent buffers: rebuild
        embeddings = tower.embeddings
        count = embeddings.position_embedding.weight.shape[0]
        embeddings.register_buffer("position_ids", torch.arange(count).unsqueeze(0),
                                   persistent=False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise OpenClipConversionError(f"tensors left without a value: {left[:6]}")
    return model.eval()
