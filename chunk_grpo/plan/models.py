"""The memory plan's model sizes: every component built on the ``meta`` device from its real config.

Where the configs come from (`resolve_model_configs`): the model directory's own
``transformer/``, ``vae/``, ``text_encoder/`` and ``text_encoder_2/`` ``config.json`` when the
model is a local directory (or "embedded"), or a hub id whose files are in the local Hugging Face
cache; otherwise copies of FLUX.1-dev's published configs shipped in
``chunk_grpo/assets/model_configs/``. Nothing is downloaded and no weight is allocated.

Reward models (`reward_parameter_counts`) are built on meta from the configs of the published
checkpoints: hpsv3 = Qwen2-VL-7B-Instruct's decoder and vision tower (no LM head; embedding rows =
the Qwen2-VL tokenizer + ``<|Reward|>``) + the authors' head; pickscore and hpsv2 = CLIP ViT-H/14;
clip = CLIP ViT-L/14; aesthetic = CLIP ViT-L/14's vision tower + the LAION MLP; imagereward =
BLIP's ViT-L/16 + the BERT-base "med" text encoder + the MLP head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from chunk_grpo.config.cli_args import EMBEDDED_MODEL_DIR
from chunk_grpo.config.reward_spec import parse_reward_spec
from chunk_grpo.models.policy_setup import resolve_lora_targets

CONFIG_DIR = Path(__file__).resolve().parents[1] / "assets" / "model_configs"
FLUX_DEV_FILES = {  # component folder -> the shipped copy of FLUX.1-dev's config.json
    "transformer": "flux1_dev_transformer.json",
    "vae": "flux1_dev_vae.json",
    "text_encoder": "flux1_dev_text_encoder.json",
    "text_encoder_2": "flux1_dev_text_encoder_2.json",
}
# HPSv3 resizes Qwen2-VL's embedding to its tokenizer (151657 tokens) plus <|Reward|>.
HPSV3_VOCAB_ROWS = 151658
# Rewards without a model on the GPU (programmatic, or scored by a server elsewhere).
NO_MODEL_REWARDS = ("jpeg_compressibility", "jpeg_incompressibility", "shapes")


@dataclass(frozen=True)
class ModelConfigs:
    """The pipeline's component configs and where they were read."""

    transformer: dict
    vae: dict
    text_encoder: dict  # CLIP text model
    text_encoder_2: dict  # T5 encoder
    source: str


def _cached_file(repo_id: str, filename: str) -> Path | None:
    """A file of a hub repository from the local cache only (never downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with diffusers
        return None
    found = try_to_load_from_cache(repo_id, filename)
    return Path(found) if isinstance(found, str) else None


def resolve_model_configs(model: str) -> ModelConfigs:
    """The four component configs of ``model`` ("embedded", a directory or a hub id)."""
    name = str(EMBEDDED_MODEL_DIR) if model == "embedded" else model
    local = Path(name).expanduser()
    paths: dict[str, Path] = {}
    if local.is_dir():
        paths = {c: local / c / "config.json" for c in FLUX_DEV_FILES}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise ValueError(f"model directory {local} lacks {', '.join(missing)}; give a "
                             f"diffusers FLUX directory (or a hub id) as model.name")
        source = f"{local} (its config.json files)"
    else:
        cached = {c: _cached_file(name, f"{c}/config.json") for c in FLUX_DEV_FILES}
        if all(cached.values()):
            paths, source = cached, f"{name} (the Hugging Face cache)"
        else:
            paths = {c: CONFIG_DIR / f for c, f in FLUX_DEV_FILES.items()}
            source = (f"FLUX.1-dev's published configs shipped in the package ({name!r} is not "
                      f"a local directory and not in the Hugging Face cache)")
    configs = {c: json.loads(p.read_text()) for c, p in paths.items()}
    return ModelConfigs(source=source, **configs)


def _public(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def build_transformer(config: dict, device: str | torch.device = "meta") -> nn.Module:
    """FluxTransformer2DModel from its config.json contents, on ``device`` (meta: no memory)."""
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        return FluxTransformer2DModel.from_config(_public(config))


def build_vae(config: dict, device: str | torch.device = "meta") -> nn.Module:
    from diffusers import AutoencoderKL

    with torch.device(device):
        return AutoencoderKL.from_config(_public(config))


def build_clip_text(config: dict) -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        return CLIPTextModel(CLIPTextConfig(**config))


def build_t5_encoder(config: dict) -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        return T5EncoderModel(T5Config(**config))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """FLUX's double-stream then single-stream blocks (the units FSDP shards one by one)."""
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def lora_parameter_count(transformer: nn.Module, rank: int, targets: list[str]) -> int:
    """Parameters peft adds for LoRA of ``rank`` on the Linear layers ``targets`` names (a
    preset or module names, resolved as the trainer resolves them): rank x (in + out) per layer
    (A and B, no bias). Raises ValueError when nothing matches."""
    names = set(resolve_lora_targets(transformer, targets))
    return sum(rank * (module.in_features + module.out_features)
               for name, module in transformer.named_modules() if name in names)


def largest_lora_tensor(transformer: nn.Module, rank: int, targets: list[str]) -> int:
    """Elements of the largest tensor peft adds for LoRA of ``rank`` on ``targets``: A is
    rank x in, B is out x rank. Raises ValueError when nothing matches."""
    names = set(resolve_lora_targets(transformer, targets))
    return max(rank * max(module.in_features, module.out_features)
               for name, module in transformer.named_modules() if name in names)


def lora_target_names(transformer: nn.Module, targets: list[str]) -> list[str]:
    """The Linear layers a LoRA on ``targets`` wraps (`policy_setup.resolve_lora_targets`)."""
    return resolve_lora_targets(transformer, targets)


# ----------------------------------------------------------------------------- rewards

def _config(name: str) -> dict:
    return json.loads((CONFIG_DIR / name).read_text())


def _clip_model(config: dict, towers: str = "both") -> nn.Module:
    from transformers import CLIPConfig, CLIPModel, CLIPVisionModelWithProjection

    clip_config = CLIPConfig(text_config=config["text_config"],
                             vision_config=config["vision_config"],
                             projection_dim=config["projection_dim"])
    with torch.device("meta"):
        if towers == "vision":
            return CLIPVisionModelWithProjection(clip_config.vision_config)
        return CLIPModel(clip_config)


def _score_mlp(width: int) -> nn.Module:
    from chunk_grpo.rewards.score_mlp import ScoreMLP

    with torch.device("meta"):
        return ScoreMLP(width)


def _hpsv3() -> int:
    from transformers import Qwen2VLConfig, Qwen2VLModel

    from chunk_grpo.rewards.hpsv3_checkpoint import make_head

    config = Qwen2VLConfig(**_config("qwen2_vl_7b_instruct.json"))
    config.text_config.vocab_size = HPSV3_VOCAB_ROWS
    with torch.device("meta"):
        backbone = Qwen2VLModel(config)
        head = make_head(config.text_config.hidden_size)
    return count_parameters(backbone) + count_parameters(head)


def _imagereward() -> int:
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    config = _config("imagereward_blip.json")
    with torch.device("meta"):
        vision = BlipVisionModel(BlipVisionConfig(**config["vision_config"]))
        text = BlipTextModel(BlipTextConfig(**config["text_config"], is_decoder=True),
                             add_pooling_layer=False)
    return (count_parameters(vision) + count_parameters(text)
            + count_parameters(_score_mlp(config["text_config"]["hidden_size"])))


def _shapes_clip() -> int:
    from transformers import CLIPConfig, CLIPModel

    from chunk_grpo.rewards.shapes_clip import SHAPES_CLIP_DIR

    with torch.device("meta"):
        return count_parameters(CLIPModel(CLIPConfig.from_pretrained(SHAPES_CLIP_DIR)))


KNOWN_REWARD_MODELS = {  # reward name -> (what it is, a function counting its parameters)
    "hpsv3": ("Qwen2-VL-7B + head", _hpsv3),
    "pickscore": ("CLIP ViT-H/14", lambda: count_parameters(_clip_model(
        _config("clip_vit_h_14.json")))),
    "hpsv2": ("CLIP ViT-H/14", lambda: count_parameters(_clip_model(
        _config("clip_vit_h_14.json")))),
    "clip": ("CLIP ViT-L/14", lambda: count_parameters(_clip_model(
        _config("clip_vit_l_14.json")))),
    "aesthetic": ("CLIP ViT-L/14 vision + MLP", lambda: count_parameters(_clip_model(
        _config("clip_vit_l_14.json"), "vision")) + count_parameters(_score_mlp(768))),
    "imagereward": ("BLIP ViT-L + BERT-base + MLP", _imagereward),
    "shapes-clip": ("the shipped tiny CLIP", _shapes_clip),
}


@dataclass(frozen=True)
class RewardModelSize:
    """One reward of the (possibly mixed) reward spec: its parameters, None when unknown."""

    name: str
    what: str
    parameters: int | None


def reward_parameter_counts(spec: str) -> list[RewardModelSize]:
    """Each reward of ``spec`` with its model's parameter count (0: no model on this device;
    None: unknown, e.g. a user module's reward)."""
    sizes = []
    for name, _weight in parse_reward_spec(spec):
        if name in NO_MODEL_REWARDS:
            sizes.append(RewardModelSize(name, "programmatic", 0))
        elif name.startswith("remote:"):
            sizes.append(RewardModelSize(name, "a reward server (not on this GPU)", 0))
        elif name in KNOWN_REWARD_MODELS:
            what, count = KNOWN_REWARD_MODELS[name]
            sizes.append(RewardModelSize(name, what, count()))
        else:
            sizes.append(RewardModelSize(name, "unknown (set --reward-gb)", None))
    return sizes



def largest_tensor(module: nn.Module) -> int:
    """Elements of the module's largest parameter or buffer."""
    return max(t.numel() for t in [*module.parameters(), *module.buffers()])
