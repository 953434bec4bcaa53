"""Where a reward model's files come from, and the checks every model reward runs at start-up.

A model is named by a local directory (or file) or by a hub id that is already in the user's
Hugging Face cache: nothing is ever downloaded (a training run must not stall on the network,
and the project's machines have none). Anything missing is a `RewardLoadError` in one line that
names the model and where to put it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from chunk_grpo.rewards.registry import RewardLoadError

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def first_line(err: BaseException) -> str:
    """An exception as one line (load errors are reported in one line)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def _hf_cache() -> str:
    return str(constants.HF_HUB_CACHE)  # read at call time: HF_HUB_CACHE / HF_HOME apply


def download_hint(repo_id: str) -> str:
    """How to get a hub model onto this machine (one line, no download here)."""
    return (f"on a machine with network run `hf download {repo_id}` (or `huggingface-cli "
            f"download {repo_id}`) and copy its cache to {_hf_cache()}, or pass a local directory")


def resolve_model_dir(name: str | os.PathLike, reward: str) -> Path:
    """The local directory of `name`: an existing directory, or a hub id's snapshot in the cache."""
    text = os.fspath(name)
    local = Path(text).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise RewardLoadError(f"reward {reward!r}: {local} is a file; pass the directory that "
                              f"holds the model's config.json")
    if isinstance(name, os.PathLike) or not _looks_like_hub_id(text):
        raise RewardLoadError(f"reward {reward!r}: model directory {local} does not exist; "
                              f"pass the directory that holds the model's config.json")
    try:
        return Path(snapshot_download(repo_id=text, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise RewardLoadError(f"reward {reward!r}: model {text!r} is not a local directory and "
                              f"not in the Hugging Face cache; {download_hint(text)}") from None


def resolve_model_file(name: str | os.PathLike, filename: str, reward: str) -> Path:
    """A weights file: `name` itself, `name/filename` for a directory, or `filename` of the hub
    repo `name` in the cache."""
    text = os.fspath(name)
    local = Path(text).expanduser()
    if local.is_file():
        return local
    if local.is_dir():
        if (local / filename).is_file():
            return local / filename
        raise RewardLoadError(f"reward {reward!r}: {local} has no {filename}; put the file there "
                              f"or pass its path")
    if isinstance(name, os.PathLike) or not _looks_like_hub_id(text):
        raise RewardLoadError(f"reward {reward!r}: weights file {local} does not exist; pass the "
                              f"path of {filename} or the directory that holds it")
    try:
        return Path(hf_hub_download(repo_id=text, filename=filename, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise RewardLoadError(f"reward {reward!r}: {filename} of {text!r} is not in the Hugging "
                              f"Face cache; on a machine with network run `hf download {text} "
                              f"{filename}` and copy its cache to {_hf_cache()}, or pass the "
                              f"file's path") from None


def check_vocabulary(tokenizer, vocab_size: int, source: str, reward: str) -> None:
    """A tokenizer must fit its text model. Missing tokenizer files can reload without any error
    as a 2-4 token stub, which encodes every prompt the same: the reward would ignore prompts."""
    n_tokens = len(tokenizer)
    # Real checkpoints may pad the embedding table a little past the tokenizer.
    if not 0.9 * vocab_size <= n_tokens <= vocab_size:
        raise RewardLoadError(f"reward {reward!r}: the tokenizer of {source} has {n_tokens} tokens "
                              f"but the model's text embedding has {vocab_size}; its tokenizer "
                              f"files are missing or belong to another model: restore them "
                              f"(tokenizer.json or vocab.json + merges.txt) from the original "
                              f"download")


def resolve_device_dtype(device: str | torch.device,
                         dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """`dtype` None means fp32 on the CPU (no fast bf16 there) and bf16 on CUDA."""
    device = torch.device(device)
    if dtype is None:
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        return device, _DTYPES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype or one of {sorted(_DTYPES)}, "
                         f"got {dtype!r}")
    return device, dtype


def check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def reward_inputs(images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, list[str]]:
    """Checked inputs of a reward call: float32 images in [0, 1] (NaN read as grey, as the shapes
    reward does) on their own device, and the prompts as a list, one per image."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of str, one per image, not a single str")
    prompts = list(prompts)
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images must be a torch.Tensor [B, 3, H, W], got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape [B, 3, H, W], got {tuple(images.shape)}")
    if images.shape[0] != len(prompts):
        raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts; pass one each")
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must all be str")
    return images.detach().float().nan_to_num(0.5).clamp(0.0, 1.0), prompts


def load_state_dict_file(path: os.PathLike, reward: str, kind: str = "state dict"
                         ) -> dict[str, torch.Tensor]:
    """The tensors of a torch checkpoint file ({"state_dict": ...} or the dict itself), read
    without unpickling code; anything else is a RewardLoadError naming the file."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and torch errors all mean "not this file"
        raise RewardLoadError(f"reward {reward!r}: cannot read {path}: {first_line(err)}") from None
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RewardLoadError(f"reward {reward!r}: {path} holds no {kind}")
    return state


def assign_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor],
                      error: type[Exception]) -> None:
    """Fill ``model`` (built on the meta device) by assignment from ``state`` in fp32, after
    checking that every tensor it needs is there, nothing is left over and every shape fits;
    a mismatch is ``error`` naming up to six keys (a converted checkpoint must match exactly)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise error(f"the checkpoint lacks weights for {missing[:6]}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise error(f"weights {type(model).__name__} has no place for: {extra[:6]}")
    wrong = [k for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise error(f"weights of unexpected shape: {wrong[:6]}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
