"""FLUX latent packing: [B, C, h, w] VAE latents <-> [B, h/2 * w/2, 4C] transformer tokens.

Same layout as diffusers' FluxPipeline (2x2 patches, channel-major inside a patch), so latents made
here can be handed to the pipeline and back.
"""

from __future__ import annotations

import torch


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to pack 2x2 patches, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[B, N, 4C] -> [B, C, 2*grid_h, 2*grid_w], where grid = (grid_h, grid_w) tokens."""
    b, n, c4 = packed.shape
    gh, gw = grid
    if gh * gw != n or c4 % 4:
        raise ValueError(f"cannot unpack {n} tokens of {c4} channels onto a {gh}x{gw} token grid")
    x = packed.view(b, gh, gw, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, gh * 2, gw * 2)


def image_ids(grid: tuple[int, int], *, device=None, dtype=torch.float32) -> torch.Tensor:
    """RoPE position ids [N, 3] of a token grid: (0, row, column), as FluxPipeline makes them."""
    gh, gw = grid
    ids = torch.zeros(gh, gw, 3)
    ids[..., 1] = torch.arange(gh)[:, None]
    ids[..., 2] = torch.arange(gw)[None, :]
    return ids.reshape(gh * gw, 3).to(device=device, dtype=dtype)
