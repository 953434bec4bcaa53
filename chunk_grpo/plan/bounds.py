"""Memory bounded before anything is allocated: a training run or an evaluation that cannot fit
in the host's memory is refused in one line, before its run directory or the model's weights.

The need is the memory plan's arithmetic (`chunk_grpo.plan.memory`: weights, optimizer state,
gradients, rollout buffers, images) with analytic lower bounds for the activations
(`chunk_grpo.plan.activations.bound_flux_call`) in place of its FakeTensor measurement, which
takes seconds; the check takes milliseconds. Every term is one the run must hold, so a refused
configuration cannot fit; one that passes may still be short by what the bounds leave out (the
CUDA start-up check, `memory_plan.check_plan`, measures instead).

The budget on the CPU is what the host can give without swapping: /proc/meminfo's MemAvailable,
or less when a cgroup (v2) memory limit is lower, shared by the processes of the host (torchrun's
LOCAL_WORLD_SIZE). A model the plan cannot size from files on disk (a hub id not downloaded, a
directory without its config.json files) is not checked: loading it says what is wrong.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

from chunk_grpo.config.cli_args import EMBEDDED_MODEL_DIR
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.models.sampling_defaults import CONFIG_NAME, SamplingDefaults
from chunk_grpo.plan.activations import CallShape, bound_flux_call, bound_vae_decode
from chunk_grpo.plan.memory import (
    GB,
    PlanDoesNotFit,
    build_plan,
    image_tokens,
    model_sizes,
    settings_from_config,
)

# The settings that size each part: what the one-line refusal tells to lower.
_KEYS_OF_PART = (
    ("the weights (fp32)", "model.name (a smaller one)"),
    ("the images kept", "model.height x model.width, --max-prompts, --images-per-prompt"),
    ("one sampling", "sampling.batch_size, model.height x model.width"),
    ("one VAE", "sampling.batch_size, model.height x model.width"),
    ("rollout buffers", "sampling.group_size x sampling.prompts_per_step, model.height x "
                        "model.width"),
    ("activations (training", "optim.micro_batch_size, chunks, model.height x model.width"),
    ("activations (", "sampling.batch_size, model.height x model.width"),
    ("reward batch", "reward.batch_size, model.height x model.width"),
    ("trainable", "model.lora_rank"), ("optimizer", "model.lora_rank"),
    ("EMA", "model.lora_rank"), ("gradients", "model.lora_rank"),
)


def host_available_bytes(meminfo: str | None = None,
                         cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the host can give without swapping: MemAvailable, or the room under a lower cgroup
    v2 limit (memory.max - memory.current); None when /proc/meminfo cannot be read."""
    try:
        meminfo = Path("/proc/meminfo").read_text() if meminfo is None else meminfo
    except OSError:
        return None
    available = None
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            available = int(value.split()[0]) * 1024
    if available is None:
        return None
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def _sized_on_disk(model: str) -> bool:
    """Whether the plan reads ``model``'s sizes from its own files (the embedded model or a
    local diffusers directory), rather than assuming FLUX.1-dev's."""
    return model == "embedded" or Path(model).expanduser().is_dir()


def _keys_of(part: str) -> str:
    return next((keys for prefix, keys in _KEYS_OF_PART if part.startswith(prefix)),
                "the settings that size it")


def _refusal(what: str, budget: float, ranks: int, parts: dict[str, float]) -> PlanDoesNotFit:
    part, nbytes = max(parts.items(), key=lambda item: item[1])
    shared = f" (each of {ranks} processes)" if ranks > 1 else ""
    return PlanDoesNotFit(
        f"not enough memory: {what} needs at least {sum(parts.values()) / GB:.1f} GB{shared}, "
        f"and {budget / GB:.1f} GB is available (MemAvailable); its largest part is {part}, "
        f"{nbytes / GB:.1f} GB: lower {_keys_of(part)}")


def check_train_memory(cfg: TrainConfig, world_size: int, available: int | None = None) -> None:
    """PlanDoesNotFit (a ConfigError, one line) when a CPU run of ``cfg`` on ``world_size``
    ranks cannot fit in the host's memory (``available``: default `host_available_bytes`)."""
    if not _sized_on_disk(cfg.model.name):
        return
    available = host_available_bytes() if available is None else available
    if available is None:
        return
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    try:  # an unknown reward counts 0 bytes: this is a lower bound
        settings = settings_from_config(cfg, world_size, device="cpu", reward_gb=0.0)
        settings = dataclasses.replace(settings, activations="bound")
        plan = build_plan(settings, available / ranks)
    except (ConfigError, ValueError, OSError):
        return  # a model the plan cannot size (no chunk_grpo.json, no config.json): loading says
    if not plan.fits:
        phase = plan.phase(plan.peak_phase)
        raise _refusal(f"the {phase.name} phase", available / ranks, ranks,
                       dict(phase.gpu_parts))


def check_evaluate_memory(model: str, *, height: int | None, width: int | None, images: int,
                          batch_size: int, hybrid_base: bool,
                          available: int | None = None) -> None:
    """PlanDoesNotFit (one line) when an evaluation on the CPU cannot fit in the host's memory:
    the fp32 model (twice with a hybrid base), one sampling call and VAE decode of a batch, and
    every image kept for scoring (``available``: default `host_available_bytes`)."""
    local = Path(model).expanduser()
    if not _sized_on_disk(model):
        return
    available = host_available_bytes() if available is None else available
    if available is None:
        return
    try:
        folder = EMBEDDED_MODEL_DIR if model == "embedded" else local
        defaults = SamplingDefaults.load(folder) if (folder / CONFIG_NAME).is_file() else None
        if (height is None or width is None) and defaults is None:
            return  # the size is the pipeline's own: loading tells it
        height, width = height or defaults.height, width or defaults.width
        text = defaults.max_sequence_length if defaults else 512
        sizes = model_sizes(model)
    except (ConfigError, ValueError, OSError):
        return
    batch = min(batch_size, images)
    tokens = image_tokens(SimpleNamespace(height=height, width=width), sizes.configs)
    weights = 4 * (sizes.transformer * (2 if hybrid_base else 1) + sizes.text_encoders
                   + sizes.vae)
    call = bound_flux_call(sizes.configs.transformer, CallShape(batch, tokens, text),
                           train=False).peak
    decode = bound_vae_decode(sizes.configs.vae, batch, height, width, 4).peak
    parts = {"the weights (fp32)": weights, "one sampling call's activations": call,
             "one VAE decode": decode, "the images kept for scoring": images * 3 * height
             * width * 4}
    if sum(parts.values()) > available:
        raise _refusal(f"the evaluation at {height}x{width}", available, 1, parts)
