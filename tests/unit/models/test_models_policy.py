"""FluxPolicy: packing, noise, velocity convention and batch consistency, prompts, decoding."""

import pytest
import torch
from diffusers import FluxPipeline
from trainer_utils import TINY_DEFAULTS, TINY_SIZES

from chunk_grpo.models import FluxPolicy, PromptEmbeds
from chunk_grpo.models.latents import image_ids, pack_latents, unpack_latents
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.shapes import VOCABULARY

PROMPTS = ["Two red circles above a blue square", "a yellow triangle", "three green squares"]
TOKENS = 16  # 32px / 4 (the VAE's 3 levels) / 2 (FLUX's 2x2 patches) = 4x4 tokens
CHANNELS = 16  # 4 latent channels * 2x2 patch
TEXT_WIDTH = 64  # T5's d_model and CLIP's pooled width at the tiny sizes


@pytest.fixture(scope="module")
def model_dir(tiny_flux):
    return tiny_flux


@pytest.fixture(scope="module")
def policy(model_dir):
    return FluxPolicy.from_pretrained(model_dir)


def test_pack_and_unpack_match_flux_pipeline():
    z = torch.randn(2, 4, 6, 8)
    packed = pack_latents(z)
    assert packed.shape == (2, 12, 16)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(z, 2, 4, 6, 8))
    torch.testing.assert_close(unpack_latents(packed, (3, 4)), z)
    # FluxPipeline's unpack takes pixel sizes; with vae_scale_factor 1 they equal latent sizes.
    torch.testing.assert_close(
        unpack_latents(packed, (3, 4)), FluxPipeline._unpack_latents(packed, 6, 8, 1)
    )
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
    torch.testing.assert_close(image_ids((3, 4)), ids)
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.randn(1, 4, 5, 6))
    with pytest.raises(ValueError, match="cannot unpack"):
        unpack_latents(packed, (4, 4))


def test_defaults_come_from_model_directory(policy):
    assert (policy.height, policy.width) == (32, 32)
    assert policy.max_sequence_length == TINY_DEFAULTS.max_sequence_length
    assert policy.default_cfg_scale == TINY_DEFAULTS.default_cfg_scale
    trainable = [n for n, p in policy.pipeline.text_encoder.named_parameters() if p.requires_grad]
    assert not trainable and all(p.requires_grad for p in policy.transformer.parameters())


def test_encode_prompts_lowercases_and_expands_groups(policy):
    embeds = policy.encode_prompts(PROMPTS)
    assert embeds.prompt_embeds.shape == (3, TINY_DEFAULTS.max_sequence_length, TEXT_WIDTH)
    assert embeds.pooled.shape == (3, TEXT_WIDTH)
    assert embeds.text_ids.shape == (TINY_DEFAULTS.max_sequence_length, 3)
    lower = policy.encode_prompts([p.lower() for p in PROMPTS])
    torch.testing.assert_close(embeds.prompt_embeds, lower.prompt_embeds, rtol=0, atol=0)
    torch.testing.assert_close(embeds.pooled, lower.pooled, rtol=0, atol=0)
    assert not torch.allclose(embeds.prompt_embeds[0], embeds.prompt_embeds[1])
    groups = embeds.repeat_interleave(2)
    assert len(groups) == 6
    torch.testing.assert_close(groups.prompt_embeds[4], embeds.prompt_embeds[2])
    torch.testing.assert_close(groups.index([5, 0]).pooled, embeds.pooled[[2, 0]])
    torch.testing.assert_close(
        PromptEmbeds.cat([embeds.index([1]), embeds.index([0])]).pooled, embeds.pooled[[1, 0]]
    )
    with pytest.raises(ValueError, match="list of strings"):
        policy.encode_prompts("a red circle")


def test_initial_noise_is_packed_and_seeded(policy):
    a = policy.initial_noise(3, torch.Generator().manual_seed(5))
    b = policy.initial_noise(3, torch.Generator().manual_seed(5))
    assert a.shape == (3, TOKENS, CHANNELS)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert policy.initial_noise(1, None, height=16, width=32).shape == (1, 8, CHANNELS)
    with pytest.raises(ValueError, match="multiples of 8"):
        policy.initial_noise(1, None, height=28, width=32)


def test_ode_steps_reproduce_flux_pipeline(policy):
    """x' = x + (s' - s) v for every step equals FluxPipeline's own Euler sampler."""
    prompts = [p.lower() for p in PROMPTS[:2]]
    steps = 3
    ref = policy.pipeline(
        prompt=prompts,
        height=32,
        width=32,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(0),
        max_sequence_length=TINY_DEFAULTS.max_sequence_length,
        output_type="latent",
    ).images
    sigmas = policy.pipeline.scheduler.sigmas
    assert len(sigmas) == steps + 1 and sigmas[0] == 1 and sigmas[-1] == 0
    embeds = policy.encode_prompts(prompts)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(2), embeds)
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


def test_velocity_is_batch_consistent_and_stateless(policy):
    embeds = policy.encode_prompts(PROMPTS)
    x = torch.randn(3, TOKENS, CHANNELS, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        batched = policy.velocity(x, sigma, embeds, cfg_scale=3.0)
        for i in range(3):
            alone = policy.velocity(
                x[i : i + 1], sigma[i : i + 1], embeds.index([i]), cfg_scale=3.0
            )
            torch.testing.assert_close(alone[0], batched[i], rtol=1e-5, atol=1e-5)
        again = policy.velocity(x, sigma, embeds, cfg_scale=3.0)
        torch.testing.assert_close(again, batched, rtol=0, atol=0)
        # Scalar sigma broadcasts; the timestep and the prompt both change the output.
        torch.testing.assert_close(
            policy.velocity(x, 0.5, embeds), policy.velocity(x, torch.full((3,), 0.5), embeds)
        )
        assert not torch.allclose(policy.velocity(x, 0.5, embeds), policy.velocity(x, 0.6, embeds))
        swapped = embeds.index([1, 0, 2])
        assert not torch.allclose(policy.velocity(x, 0.5, embeds), policy.velocity(x, 0.5, swapped))


def test_cfg_combines_conditional_and_negative(policy):
    embeds = policy.encode_prompts(PROMPTS[:2])
    negative = policy.negative_embeds(2)
    x = torch.randn(2, TOKENS, CHANNELS, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        v_cond = policy.velocity(x, 0.4, embeds)
        v_neg = policy.velocity(x, 0.4, negative)
        guided = policy.velocity(x, 0.4, embeds, cfg_scale=2.5)
    torch.testing.assert_close(guided, v_neg + 2.5 * (v_cond - v_neg), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(negative.pooled, policy.encode_prompts([""] * 2).pooled)


def test_velocity_is_differentiable_in_transformer_weights(policy):
    embeds = policy.encode_prompts(PROMPTS[:1])
    x = torch.randn(1, TOKENS, CHANNELS)
    policy.transformer.zero_grad()
    policy.velocity(x, 0.5, embeds).square().mean().backward()
    grad = policy.transformer.proj_out.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    policy.transformer.zero_grad()


def test_velocity_rejects_bad_shapes(policy):
    embeds = policy.encode_prompts(PROMPTS[:2])
    with pytest.raises(ValueError, match="packed"):
        policy.velocity(torch.randn(2, 4, 16, 16), 0.5, embeds)
    with pytest.raises(ValueError, match="expand it first"):
        policy.velocity(torch.randn(3, TOKENS, CHANNELS), 0.5, embeds)
    with pytest.raises(ValueError, match="sigma"):
        policy.velocity(torch.randn(2, TOKENS, CHANNELS), torch.ones(3), embeds)
    with pytest.raises(ValueError, match="height= and width="):
        policy.velocity(torch.randn(2, 40, 16), 0.5, embeds)


def test_decode_range_and_encode_round_trip_shapes(policy):
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    images = policy.decode(x * 10)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    latents = policy.encode_images(images)
    assert latents.shape == x.shape
    # The VAE normalisation is applied exactly inversely on encode and decode.
    vae = policy.vae
    z = vae.encode(images * 2 - 1).latent_dist.mode()
    expected = pack_latents((z - vae.config.shift_factor) * vae.config.scaling_factor)
    torch.testing.assert_close(latents, expected)


def test_guidance_distilled_model_gets_its_guidance_scale(tmp_path):
    """FLUX.1-dev's path: the transformer embeds `guidance_scale`; no chunk_grpo.json there."""
    pipeline = build_tiny_flux_pipeline(VOCABULARY, **TINY_SIZES, guidance_embeds=True)
    pipeline.save_pretrained(tmp_path)
    policy = FluxPolicy.from_pretrained(tmp_path)
    assert (policy.height, policy.max_sequence_length, policy.guidance_scale) == (1024, 512, 3.5)
    embeds = policy.encode_prompts(["a red circle"])
    x = torch.randn(1, TOKENS, CHANNELS)
    with torch.no_grad():
        v_default = policy.velocity(x, 0.5, embeds, height=32, width=32)
        policy.guidance_scale = 1.0
        v_low = policy.velocity(x, 0.5, embeds, height=32, width=32)
    assert not torch.allclose(v_default, v_low)
