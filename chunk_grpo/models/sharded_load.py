"""Load the FLUX transformer straight into its FSDP2 shards: no rank ever holds a full copy.

The order (torchtitan's): the transformer is built on the ``meta`` device from its config.json
(`meta_transformer`), prepared as the trainer prepares it (LoRA adapters, gradient checkpointing,
attention backend), sharded block by block with `fully_shard` (`chunk_grpo.runtime.parallelize`),
then materialised with `to_empty` (each rank allocates only its dim-0 shards) and filled
(`fill_from_checkpoint`): each rank opens the checkpoint's safetensors files with `safe_open`
(memory-mapped: the page cache is shared by the ranks of a node) and reads only its own rows of
each tensor, cast to the parameter's dtype on its device. So:

- host memory per node: the checkpoint's page cache plus one shard-sized temporary per rank;
- device memory per rank: its shards plus one shard-sized temporary (no full tensor at all).

LoRA adapters are not in the checkpoint: A from a generator seeded by (seed, name), B zero
(`policy_setup.seed_lora_weights`), the values an unsharded load with the same seed gives.
The frozen hybrid-evaluation base of full fine-tuning (`sharded_frozen_copy`) is built the same
way and filled from the policy's own local shards, cast to ``weights_dtype``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import diffusers
import torch
from safetensors import safe_open
from torch.distributed.fsdp import FSDPModule

from chunk_grpo.models.loading import ModelLoadError
from chunk_grpo.models.policy_setup import seed_lora_weights
from chunk_grpo.runtime.parallelize import local_rows

WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = WEIGHTS + ".index.json"  # a checkpoint split over several files (FLUX.1-dev)


def transformer_weight_files(model_dir: Path) -> dict[str, Path]:
    """Every tensor of ``model_dir``'s transformer and the safetensors file that holds it: one
    file, or several named by the diffusers index json."""
    folder = Path(model_dir) / "transformer"
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / WEIGHTS
    if not single.is_file():
        raise ModelLoadError(f"{folder} has neither {WEIGHTS} nor {WEIGHTS_INDEX}: sharded "
                             f"loading (parallel.mode fsdp) reads diffusers safetensors; convert "
                             f"the weights with save_pretrained(safe_serialization=True)")
    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def meta_transformer(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """``model_dir``'s transformer built from its config.json on the ``meta`` device, in
    ``dtype``: its structure and names, no memory."""
    config_file = Path(model_dir) / "transformer" / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file} does not exist: give a diffusers FLUX directory")
    config = json.loads(config_file.read_text())
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    return torch.nn.Module.to(model, dtype)  # (diffusers' own `to` warns about fp32 modules)


def _checkpoint_name(name: str) -> str:
    """The checkpoint's name of a parameter (peft wraps an adapted layer as ``base_layer``)."""
    return name.replace(".base_layer.", ".")


def fill_from_checkpoint(transformer: torch.nn.Module, model_dir: Path, *,
                         device: torch.device | str, lora_seed: int) -> None:
    """Materialise a (sharded) meta transformer on ``device`` and fill each rank's rows from
    ``model_dir``'s safetensors; LoRA adapters from ``lora_seed``. Every parameter must come
    from the checkpoint or be an adapter, and every checkpoint tensor must be used."""
    files = transformer_weight_files(model_dir)
    transformer.to_empty(device=device)
    if any(True for _ in transformer.buffers()):  # to_empty leaves them uninitialised
        raise ModelLoadError(f"{type(transformer).__name__} has buffers, which sharded loading "
                             f"does not fill; use parallel.mode ddp")
    used = set()
    with ExitStack() as stack, torch.no_grad():
        handles = {path: stack.enter_context(safe_open(path, framework="pt"))
                   for path in sorted(set(files.values()))}
        for name, param in transformer.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                continue
            key = _checkpoint_name(name)
            if key not in files:
                raise ModelLoadError(f"{model_dir}: the transformer's weight {key} is not in its "
                                     f"checkpoint; the config.json and the weights disagree")
            used.add(key)
            stored = handles[files[key]].get_slice(key)
            if tuple(stored.get_shape()) != tuple(param.shape):
                raise ModelLoadError(f"{model_dir}: {key} has shape {stored.get_shape()} in the "
                                     f"checkpoint but {list(param.shape)} in the model")
            local, start = local_rows(param)
            if param.ndim == 0:
                local.copy_(stored[:])
            elif local.shape[0]:
                local.copy_(stored[start:start + local.shape[0]])  # only this rank's rows
    extra = sorted(set(files) - used)
    if extra:
        raise ModelLoadError(f"{model_dir}: its checkpoint has weights the model lacks, e.g. "
                             f"{extra[:3]}; the config.json and the weights disagree")
    seed_lora_weights(transformer, lora_seed)


def unsharded_class(module: torch.nn.Module) -> type:
    """The module's own class (fully_shard swaps in a subclass that is also an FSDPModule)."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def sharded_frozen_copy(transformer: torch.nn.Module, dtype: torch.dtype,
                        shard: Callable[[torch.nn.Module], object]) -> torch.nn.Module:
    """A frozen copy of a sharded (plain, not LoRA) transformer in ``dtype``, sharded by
    ``shard`` as the transformer is (the same dim-0 rows on each rank), then filled from the
    transformer's own local shards: never a full copy on any rank."""
    with torch.device("meta"):
        copy = unsharded_class(transformer).from_config(transformer.config)
    torch.nn.Module.to(copy, dtype).requires_grad_(False).eval()
    shard(copy)
    sources = dict(transformer.named_parameters())
    copy.to_empty(device=next(iter(sources.values())).device)
    with torch.no_grad():
        for name, param in copy.named_parameters():
            local, start = local_rows(param)
            source, source_start = local_rows(sources[name])
            if (start, local.shape) != (source_start, source.shape):
                raise RuntimeError(f"sharded_frozen_copy: {name} is sharded differently "
                                   f"({start}, {list(local.shape)}) from the transformer")
            local.copy_(source)
    return copy
