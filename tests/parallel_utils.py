"""The tiny FLUX transformers, batches and training loop the distributed tests share.

`train` runs optimizer steps of a fixed global batch (GLOBAL_ROWS rows per step, from
`step_batch`), split over the ranks as micro-batches of MICRO_ROWS rows, with gradient sync only
on each rank's last micro-batch, global grad-norm clipping and the agreed skip flag: the loop
the trainer runs, so 1 process and N ranks see the same global batch.
"""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig

from chunk_grpo.runtime.parallelize import any_rank, clip_grad_norm, sync_gradients, unwrapped

TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
# FLUX.1-dev's transformer/config.json with reduced width and depth: its block structure,
# 64 input channels, guidance embedding and CLIP's 768 pooled width; heads 24 -> 2, head width
# 128 -> 16 (rope axes 16/56/56 -> 4/6/6), T5 width 4096 -> 64, 19/38 blocks -> 1/1.
FLUX_DEV_REDUCED = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=1,
                        num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                        joint_attention_dim=64, pooled_projection_dim=768, guidance_embeds=True,
                        axes_dims_rope=(4, 6, 6))
ATTENTION_TEXT = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                  "to_add_out"]
GLOBAL_ROWS, MICRO_ROWS, STEPS, LR, MAX_NORM = 8, 2, 3, 1e-2, 0.01
TOKENS, TEXT_TOKENS = 16, 8


def build_transformer(lora: bool, sizes: dict = TINY, seed: int = 0) -> FluxTransformer2DModel:
    """The same random weights on every rank (FSDP shards each rank's own copy)."""
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**sizes)
    if lora:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=ATTENTION_TEXT,
                                     init_lora_weights="gaussian"))
        with torch.no_grad():  # non-zero B, so every adapter weight has a gradient at once
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def step_batch(step: int, sizes: dict = TINY) -> dict:
    """The global batch of optimizer step ``step``: inputs and a regression target."""
    g = torch.Generator().manual_seed(1000 + step)
    n = GLOBAL_ROWS
    batch = dict(
        hidden_states=torch.randn(n, TOKENS, sizes["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(n, TEXT_TOKENS, sizes["joint_attention_dim"],
                                          generator=g),
        pooled_projections=torch.randn(n, sizes["pooled_projection_dim"], generator=g),
        timestep=torch.rand(n, generator=g),
        target=torch.randn(n, TOKENS, sizes["in_channels"], generator=g),
    )
    if sizes.get("guidance_embeds"):
        batch["guidance"] = torch.full((n,), 3.5)
    return batch


def output_of(call, batch: dict, rows: slice) -> torch.Tensor:
    """The transformer's output for rows ``rows`` of ``batch``."""
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                     indexing="ij"), -1).reshape(TOKENS, 3)
    inputs = {k: v[rows] for k, v in batch.items() if k != "target"}
    return call(**inputs, img_ids=ids, txt_ids=torch.zeros(TEXT_TOKENS, 3), return_dict=False)[0]


def loss_of(call, batch: dict, rows: slice) -> torch.Tensor:
    return (output_of(call, batch, rows).float() - batch["target"][rows]).pow(2).mean()


def make_optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def train(call, params: list, rank: int, world: int, sizes: dict = TINY, *,
          optimizer: torch.optim.Optimizer | None = None, steps: range = range(STEPS),
          micro_rows: int = MICRO_ROWS) -> list[float]:
    """Optimizer steps ``steps``; each rank takes its micro-batches of ``micro_rows`` rows of
    the global batch. Returns the norms before clipping."""
    micro = GLOBAL_ROWS // (world * micro_rows)
    optimizer = optimizer or make_optimizer(params)
    norms = []
    for step in steps:
        batch = step_batch(step, sizes)
        for k in range(micro):
            start = (k * world + rank) * micro_rows
            with sync_gradients(call, enabled=k == micro - 1):
                (loss_of(call, batch, slice(start, start + micro_rows)) / micro).backward()
        norm = clip_grad_norm(params, MAX_NORM)
        if not any_rank(~torch.isfinite(norm)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        norms.append(float(norm))
    return norms


def full_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable weight as a full CPU tensor (gathered from the shards under FSDP)."""
    state = {}
    for name, p in unwrapped(model).named_parameters():
        if p.requires_grad:
            value = p.full_tensor() if hasattr(p, "full_tensor") else p
            state[name] = value.detach().cpu().clone()
    return state
