"""Loading the authors' HPSv3 checkpoint onto transformers' current Qwen2-VL classes.

What the authors publish (facts from github.com/MizzenAI/HPSv3 and huggingface.co/MizzenAI/HPSv3):
- `HPSv3.safetensors` (16.6 GB): the state dict of their `Qwen2VLRewardModelBT`, a
  `Qwen2VLForConditionalGeneration` of transformers 4.45/4.46 plus an `rm_head`, trained with a
  bf16 backbone and an fp32 head. Its keys use that version's flat module layout. Its embedding
  was resized to the Qwen2-VL tokenizer plus one added special token, `<|Reward|>`
  (`resize_token_embeddings(len(tokenizer))`); we read the row count from the file.
- The config and processor are Qwen/Qwen2-VL-7B-Instruct's, unchanged; the authors add
  `<|Reward|>` to the tokenizer at load time, and so do we.

Key mapping (checkpoint -> this module), one documented rule per prefix:
    visual.*   -> backbone.visual.*            (Qwen2VLModel.visual in transformers 5)
    model.*    -> backbone.language_model.*    (the text decoder)
    rm_head.*  -> head.*                       (indices 0, 3, 5: the three Linear layers)
    lm_head.*  -> not loaded                   (scoring never reads the LM head)
Every other key, every missing key and every shape mismatch is an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from chunk_grpo.rewards.registry import RewardLoadError

HUB_ID = "MizzenAI/HPSv3"
BASE_MODEL_ID = "Qwen/Qwen2-VL-7B-Instruct"
CHECKPOINT_FILE = "HPSv3.safetensors"
REWARD_TOKEN = "<|Reward|>"
# Tokens the prompt template uses; each must be one id of the tokenizer.
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                   "<|vision_end|>")
# The authors' `ranknet` head with rm_head_kwargs=None: hidden -> 1024 -> 16 -> (mu, sigma).
HEAD_SIZES = (1024, 16, 2)
HEAD_DROPOUT = 0.05
# Qwen2-VL-7B-Instruct's preprocessor_config.json (the processor the authors load unchanged).
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
EMBED_KEY = "model.embed_tokens.weight"  # its rows: the tokenizer + <|Reward|>
_PROCESSOR_FILES = ("config.json", "preprocessor_config.json", "tokenizer_config.json")


class HPSv3LoadError(RewardLoadError):
    """The HPSv3 checkpoint or its Qwen2-VL files cannot be loaded as asked; says how to fix it."""


def _hint(target: str) -> str:
    return (f"get it with `hf download {HUB_ID} {CHECKPOINT_FILE} --local-dir {target}` and "
            f"`hf download {BASE_MODEL_ID} --include '*.json' '*.txt' --local-dir {target}`")


def make_head(hidden_size: int) -> nn.Sequential:
    """The authors' reward head; its module indices (0, 3, 5) are the checkpoint's key names."""
    wide, narrow, out = HEAD_SIZES
    return nn.Sequential(nn.Linear(hidden_size, wide), nn.ReLU(), nn.Dropout(HEAD_DROPOUT),
                         nn.Linear(wide, narrow), nn.ReLU(), nn.Linear(narrow, out))


def map_checkpoint_key(key: str) -> tuple[str, str] | None:
    """("backbone" | "head", new key) for a checkpoint key, None for keys scoring does not use."""
    if key.startswith("visual."):
        return "backbone", key
    if key.startswith("model."):
        return "backbone", "language_model." + key[len("model."):]
    if key.startswith("rm_head."):
        return "head", key[len("rm_head."):]
    if key.startswith("lm_head."):
        return None
    raise HPSv3LoadError(f"unexpected key {key!r} in the HPSv3 checkpoint; it is not the "
                         f"authors' {CHECKPOINT_FILE}")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def _cached_snapshot(repo_id: str, what: str) -> Path:
    """The local snapshot of a hub repository, from the user's cache only (never downloaded)."""
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as err:  # LocalEntryNotFoundError, or a malformed cache
        raise HPSv3LoadError(
            f"{what} {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
            f" and is never downloaded here ({type(err).__name__}); pass a local directory "
            f"instead: {_hint('DIR')}") from None


def resolve_files(model: str | os.PathLike, processor: str | os.PathLike | None
                  ) -> tuple[Path, Path]:
    """(path of HPSv3.safetensors, directory of the Qwen2-VL config and processor files)."""
    name = os.fspath(model)
    local = Path(name).expanduser()
    if isinstance(model, os.PathLike) or local.exists() or not _looks_like_hub_id(name):
        if not local.is_dir():
            raise HPSv3LoadError(f"HPSv3 model directory {local} does not exist; {_hint(name)}")
        checkpoint_dir, default_processor = local, local
    else:
        checkpoint_dir = _cached_snapshot(name, "HPSv3 checkpoint")
        default_processor = None
    if processor is None:
        processor_dir = default_processor or _cached_snapshot(BASE_MODEL_ID, "Qwen2-VL processor")
    else:
        proc = os.fspath(processor)
        processor_dir = Path(proc).expanduser()
        if not processor_dir.exists() and _looks_like_hub_id(proc):
            processor_dir = _cached_snapshot(proc, "Qwen2-VL processor")
    checkpoint = checkpoint_dir / CHECKPOINT_FILE
    if not checkpoint.is_file():
        raise HPSv3LoadError(f"{checkpoint_dir} has no {CHECKPOINT_FILE}; {_hint(name)}")
    missing = [f for f in _PROCESSOR_FILES if not (processor_dir / f).is_file()]
    has_vocab = (processor_dir / "tokenizer.json").is_file() or all(
        (processor_dir / f).is_file() for f in ("vocab.json", "merges.txt"))
    if not has_vocab:
        missing.append("tokenizer.json")
    if missing:
        raise HPSv3LoadError(f"{processor_dir} lacks the Qwen2-VL files {', '.join(missing)}; "
                             f"{_hint(str(processor_dir))}")
    return checkpoint, processor_dir


def load_config(processor_dir: Path):
    """The Qwen2-VL config (the base model's config.json, as the authors use it)."""
    from transformers import Qwen2VLConfig

    model_type = json.loads((processor_dir / "config.json").read_text()).get("model_type")
    if model_type != "qwen2_vl":
        raise HPSv3LoadError(f"{processor_dir}/config.json is a {model_type!r} config, not "
                             f"Qwen2-VL's; {_hint(str(processor_dir))}")
    return Qwen2VLConfig.from_pretrained(processor_dir, local_files_only=True)


def load_tokenizer(processor_dir: Path, config, vocab_rows: int):
    """Qwen2-VL's tokenizer plus `<|Reward|>`, checked against the checkpoint's vocabulary."""
    from transformers import AutoTokenizer

    source = f"{processor_dir} (tokenizer)"
    tokenizer = AutoTokenizer.from_pretrained(processor_dir, local_files_only=True)
    for token in TEMPLATE_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1 or tokenizer.convert_tokens_to_ids(token) != ids[0]:
            raise HPSv3LoadError(f"{source} has no special token {token}; these are not "
                                 f"Qwen2-VL's tokenizer files: {_hint(str(processor_dir))}")
    for token, expected in (("<|image_pad|>", config.image_token_id),
                            ("<|vision_start|>", config.vision_start_token_id)):
        found = tokenizer.convert_tokens_to_ids(token)
        if found != expected:
            raise HPSv3LoadError(f"{source} maps {token} to {found} but config.json expects "
                                 f"{expected}; restore both from {BASE_MODEL_ID}")
    if REWARD_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    if len(tokenizer) != vocab_rows:
        raise HPSv3LoadError(f"{source} has {len(tokenizer)} tokens with {REWARD_TOKEN} but the "
                             f"checkpoint's embedding has {vocab_rows} rows; the tokenizer does not"
                             f" match the model: {_hint(str(processor_dir))}")
    tokenizer.padding_side = "right"  # as the authors' processor: the reward token is not shifted
    return tokenizer


def load_image_processor(processor_dir: Path, config):
    """Qwen2-VL's image processor (PIL backend: no torchvision), checked against the published
    constants and the vision tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil.from_pretrained(processor_dir, local_files_only=True)
    found = (proc.patch_size, proc.merge_size, proc.temporal_patch_size,
             tuple(proc.image_mean), tuple(proc.image_std))
    published = (PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE, CLIP_MEAN, CLIP_STD)
    vision = config.vision_config
    tower = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    if found != published or tower != published[:3]:
        raise HPSv3LoadError(f"{processor_dir}: image preprocessing (patch, merge, temporal, mean,"
                             f" std) = {found}, vision tower {tower}; HPSv3 needs {published} "
                             f"from {BASE_MODEL_ID}'s preprocessor_config.json")
    return proc


def read_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the checkpoint (reads the header only), checked to be HPSv3's."""
    from safetensors import safe_open

    try:
        with safe_open(str(checkpoint), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as err:
        raise HPSv3LoadError(f"cannot read {checkpoint} ({err}); {_hint(str(checkpoint.parent))}"
                             ) from None
    if EMBED_KEY not in shapes:
        raise HPSv3LoadError(f"{checkpoint} has no {EMBED_KEY}; it is not the authors' "
                             f"{CHECKPOINT_FILE}: {_hint(str(checkpoint.parent))}")
    return shapes


def build_model(checkpoint: Path, shapes: dict[str, tuple[int, ...]], config, dtype: torch.dtype,
                device: torch.device) -> tuple[nn.Module, nn.Sequential]:
    """(Qwen2VLModel in `dtype`, fp32 head) on `device`, holding the checkpoint's weights."""
    from safetensors import safe_open
    from transformers import Qwen2VLModel
    from transformers.initialization import no_init_weights

    config.text_config.vocab_size = shapes[EMBED_KEY][0]  # resized to the tokenizer + <|Reward|>
    # Allocated on the device and never initialised: every weight is overwritten below, and a
    # 7B model then needs no copy in host memory.
    with no_init_weights(), device:
        backbone = Qwen2VLModel._from_config(config, dtype=dtype, attn_implementation="sdpa")
        head = make_head(config.text_config.hidden_size)
    targets = {"backbone": backbone.state_dict(), "head": head.state_dict()}
    mapped = {key: map_checkpoint_key(key) for key in shapes}
    wanted = {(part, key) for part, state in targets.items() for key in state}
    present = {target for target in mapped.values() if target is not None}
    if wanted != present:
        missing = sorted(f"{p}.{k}" for p, k in wanted - present)[:4]
        extra = sorted(f"{p}.{k}" for p, k in present - wanted)[:4]
        raise HPSv3LoadError(f"{checkpoint} does not match the Qwen2-VL config in config.json: "
                             f"missing {missing}, unexpected {extra}")
    with safe_open(str(checkpoint), framework="pt") as f, torch.no_grad():
        for key, target in mapped.items():
            if target is None:
                continue
            param = targets[target[0]][target[1]]
            if tuple(param.shape) != shapes[key]:
                raise HPSv3LoadError(f"{checkpoint}: {key} has shape {shapes[key]} but config.json"
                                     f" gives {tuple(param.shape)}; use {BASE_MODEL_ID}'s config")
            param.copy_(f.get_tensor(key))  # one tensor at a time: peak memory ~ one model
    return backbone.eval(), head.float().eval()
