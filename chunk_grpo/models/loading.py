"""One loader for every FLUX pipeline: the shipped tiny model, a local FLUX.1-dev copy, or a hub id.

Nothing here falls back to another model. A missing directory, missing weights, an offline machine
or a tokenizer that silently reloaded as a stub all raise `ModelLoadError` saying what to download
and where to put it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

import torch
from diffusers import FluxPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

FLUX_DEV_ID = "black-forest-labs/FLUX.1-dev"
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
# (tokenizer attribute, text encoder attribute) pairs FluxPipeline uses.
_TOKENIZER_PAIRS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
# The components with weights; the transformer first (it may be given instead of loaded).
_MODEL_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")


class ModelLoadError(ValueError):
    """The model named by `path_or_id` cannot be loaded as asked; the message says how to fix it."""


def _download_hint(target: str) -> str:
    return (
        f"Download the diffusers-format weights on a machine with network access, e.g.\n"
        f"  hf download {FLUX_DEV_ID} --local-dir {target}\n"
        f"(FLUX.1-dev is gated: accept its licence on huggingface.co and `hf auth login` first), "
        f"then pass that directory as the model path. The built-in tiny model is "
        f"chunk_grpo.models.EMBEDDED_MODEL."
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not name.startswith((".", "~"))
        and not os.path.isabs(name)
    )


def _check_local_directory(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(
            f"model directory {path} does not exist.\n" + _download_hint(str(path))
        )
    index = path / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(
            f"{path} is not a diffusers pipeline directory (no model_index.json).\n"
            + _download_hint(str(path))
        )
    components = json.loads(index.read_text())
    missing = []
    for name, spec in components.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        folder = path / name
        if not folder.is_dir():
            missing.append(f"{name}/ (folder missing)")
        elif name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
            if not any(f.name.endswith(_WEIGHT_SUFFIXES) for f in folder.iterdir()):
                missing.append(f"{name}/ (no .safetensors weights)")
    if missing:
        raise ModelLoadError(
            f"model directory {path} is incomplete: {', '.join(missing)}.\n"
            + _download_hint(str(path))
        )


def check_tokenizers(pipeline: FluxPipeline, source: str) -> None:
    """Fail if a tokenizer does not match its text encoder's vocabulary.

    With missing tokenizer files (and HF_HUB_OFFLINE=1) transformers can build a 2- to 4-token stub
    without any error; every prompt then encodes to the same ids and the model ignores its prompt.
    """
    for tok_name, enc_name in _TOKENIZER_PAIRS:
        tokenizer = getattr(pipeline, tok_name, None)
        encoder = getattr(pipeline, enc_name, None)
        if tokenizer is None or encoder is None:
            raise ModelLoadError(f"{source}: the pipeline has no {tok_name}/{enc_name}")
        n_tokens, vocab_size = len(tokenizer), encoder.config.vocab_size
        # Real checkpoints pad the embedding table a little (T5: 32100 tokens, 32128 rows).
        if not (0.9 * vocab_size <= n_tokens <= vocab_size):
            raise ModelLoadError(
                f"{source}: {tok_name} has {n_tokens} tokens but {enc_name} expects a "
                f"vocabulary of {vocab_size}; the tokenizer files are missing or broken "
                f"(offline loading can silently build a stub tokenizer). Restore "
                f"{source}/{tok_name}/ from the original download.\n" + _download_hint(source)
            )


def _follow_progress_bar_setting() -> None:
    """diffusers' and transformers' loading bars obey HF_HUB_DISABLE_PROGRESS_BARS only for
    downloads; the commands set it when quiet (`chunk_grpo.runtime.quiet.quiet_third_party`), so
    apply it to the loading bars too."""
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() in ("1", "true", "yes"):
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()


def resolve_pipeline_dir(path_or_id: str | os.PathLike) -> tuple[Path, str]:
    """(the local pipeline directory, how to name the model in messages) for a local directory
    or a hub id (from the Hugging Face cache, downloaded unless HF_HUB_OFFLINE is set)."""
    name = os.fspath(path_or_id)
    local = Path(name).expanduser()
    if isinstance(path_or_id, os.PathLike) or local.exists() or not _looks_like_hub_id(name):
        _check_local_directory(local)
        return local, str(local)
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return Path(FluxPipeline.download(name, local_files_only=offline)), name
    except (OSError, ValueError) as err:
        why = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE})"
            if offline
            else "downloading it failed (no network, or a gated model without a login token)"
        )
        raise ModelLoadError(
            f"cannot load hub model {name!r}: {why}: {err}\n"
            + _download_hint(f"/path/to/{name.split('/')[-1]}")
        ) from err


def component_class(local: Path, name: str) -> type:
    """The class model_index.json names for component ``name`` (e.g. T5EncoderModel)."""
    library, class_name = json.loads((local / "model_index.json").read_text())[name][:2]
    return getattr(importlib.import_module(library), class_name)


def load_flux_pipeline(
    path_or_id: str | os.PathLike,
    *,
    dtype: torch.dtype | dict[str, torch.dtype] = torch.float32,
    device: str | torch.device = "cpu",
    skip: tuple[str, ...] = (),
    devices: dict[str, str | torch.device] | None = None,
    transformer: torch.nn.Module | None = None,
) -> FluxPipeline:
    """Load a FLUX diffusers pipeline from a local directory or a hub id, and check it.

    ``dtype``: one for every component, or per component as diffusers takes it, e.g.
    ``{"transformer": torch.float32, "default": torch.bfloat16}``. Each model component loads
    in its dtype straight to its device (``devices[name]``, default ``device``) from the
    memory-mapped safetensors: no detour through fp32 or a host copy to move afterwards.
    ``transformer``: one to use instead of loading it (e.g. built on the ``meta`` device for
    sharded loading, `chunk_grpo.models.sharded_load`); it is left where it is. ``skip``: components
    not to load (None in the pipeline), e.g. ``("transformer", "vae")`` for the text encoders
    only."""
    _follow_progress_bar_setting()
    local, source = resolve_pipeline_dir(path_or_id)
    dtypes = dtype if isinstance(dtype, dict) else {"default": dtype}
    devices = devices or {}
    # accelerate places weights as they are read; without it, load on the CPU and move.
    direct = importlib.util.find_spec("accelerate") is not None
    models: dict[str, torch.nn.Module | None] = {name: None for name in skip}
    try:
        for name in _MODEL_COMPONENTS:
            if name in skip or (name == "transformer" and transformer is not None):
                continue
            where = torch.device(devices.get(name, device))
            model = component_class(local, name).from_pretrained(
                local, subfolder=name, dtype=dtypes.get(name, dtypes["default"]),
                local_files_only=True, device_map=where if direct else None)
            models[name] = model if direct else model.to(where)
        if transformer is not None:
            models["transformer"] = transformer
        pipeline = FluxPipeline.from_pretrained(local, local_files_only=True, **models)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"could not load the pipeline in {source}: {err}\n" + _download_hint(source)
        ) from err
    check_tokenizers(pipeline, source)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
