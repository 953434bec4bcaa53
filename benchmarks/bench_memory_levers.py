"""Weight memory of FLUX.1-dev per GPU, before and after the memory levers of
`model.weights_dtype`, `model.text_encoders: cache` and the hybrid base from the same weights.

    python benchmarks/bench_memory_levers.py [--lora-rank 64] [--lora-targets attention+text]

Every component is built on the `meta` device from FLUX.1-dev's published configs (the
transformer's config.json, T5-v1.1-XXL's encoder, CLIP ViT-L/14's text model, FLUX's 16-channel
VAE): the byte counts are exact, nothing is allocated or downloaded. Only the weights are counted
(not gradients, optimizer state or activations; `chunk_grpo.plan` adds those), for one process
that holds the whole model (no sharding).
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from chunk_grpo.models.policy_setup import prepare_transformer

GB = 1e9
FLUX_DEV_TRANSFORMER = dict(attention_head_dim=128, axes_dims_rope=(16, 56, 56),
                            guidance_embeds=True, in_channels=64, joint_attention_dim=4096,
                            num_attention_heads=24, num_layers=19, num_single_layers=38,
                            patch_size=1, pooled_projection_dim=768)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, projection_dim=768)
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
                block_out_channels=(128, 256, 512, 512), norm_num_groups=32,
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4,
                use_quant_conv=False, use_post_quant_conv=False)


def _count(module: torch.nn.Module, trainable: bool | None = None) -> int:
    return sum(p.numel() for p in module.parameters()
               if trainable is None or p.requires_grad == trainable)


def parameter_counts(lora_rank: int, lora_targets: str) -> dict[str, int]:
    """Parameters of each component, and of the LoRA adapters for ``lora_targets``."""
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FLUX_DEV_TRANSFORMER)
        t5 = T5EncoderModel(T5Config(**T5_XXL))
        clip = CLIPTextModel(CLIPTextConfig(**CLIP_L))
        vae = AutoencoderKL(**FLUX_VAE)
        counts = {"transformer": _count(transformer), "t5": _count(t5), "clip": _count(clip),
                  "vae": _count(vae)}
        prepare_transformer(transformer, lora_rank=lora_rank, lora_alpha=None,
                            lora_targets=[lora_targets], gradient_checkpointing=False,
                            attention_backend="native")
    counts["lora"] = _count(transformer, trainable=True)
    return counts


def weight_table(n: dict[str, int]) -> list[tuple[str, float, float]]:
    """(setting, GB with LoRA, GB with full fine-tuning) of weights per GPU."""
    encoders = n["t5"] + n["clip"]
    pipeline = n["transformer"] + encoders + n["vae"]
    fp32, bf16 = 4, 2
    return [
        # Before: everything fp32, the hybrid base a second full pipeline (load_policy twice).
        ("before: all fp32, base = 2nd pipeline",
         2 * pipeline * fp32 + n["lora"] * fp32, 2 * pipeline * fp32),
        ("weights_dtype bf16",
         pipeline * bf16 + n["lora"] * fp32 + pipeline * bf16,
         n["transformer"] * fp32 + (encoders + n["vae"]) * bf16 + pipeline * bf16),
        ("+ base from the same weights",
         pipeline * bf16 + n["lora"] * fp32,
         n["transformer"] * fp32 + (encoders + n["vae"]) * bf16 + n["transformer"] * bf16),
        ("+ text_encoders: cache (freed)",
         (n["transformer"] + n["vae"]) * bf16 + n["lora"] * fp32,
         n["transformer"] * fp32 + n["vae"] * bf16 + n["transformer"] * bf16),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--lora-targets", default="attention+text")
    args = parser.parse_args()
    n = parameter_counts(args.lora_rank, args.lora_targets)
    print("parameters: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in n.items())
          + f" (LoRA r={args.lora_rank}, {args.lora_targets})")
    print(f"| weights per GPU (GB) | LoRA r={args.lora_rank} | full fine-tuning |")
    print("|---|---|---|")
    for name, lora, full in weight_table(n):
        print(f"| {name} | {lora / GB:.1f} | {full / GB:.1f} |")


if __name__ == "__main__":
    main()
