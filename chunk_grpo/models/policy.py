"""`FluxPolicy`: what the trainer needs from a FLUX pipeline, and nothing hidden.

Prompts are encoded once (`encode_prompts`) and expanded into groups without re-encoding. The
velocity follows the flow-matching convention x_sigma = (1 - sigma) * x0 + sigma * noise, so an ODE
step is x' = x + (sigma' - sigma) * v -- the same step FluxPipeline's scheduler takes. `velocity`
is a pure function of its inputs and the transformer's weights: a sample evaluated alone or inside
a batch gives the same result up to float rounding, which recomputed log-probs rely on.

Memory (`chunk_grpo.runtime.weights_dtype`, `chunk_grpo.models.prompt_cache`): the frozen parts may
be loaded in bf16 while trained weights stay fp32; the text encoders may sit on the CPU, or be freed
once every prompt's embeddings are cached on disk (`prompt_cache`), after which prompts are looked
up there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import FluxPipeline

from chunk_grpo.data.prompts import reads_lowercase_only
from chunk_grpo.models.latents import image_ids, pack_latents, unpack_latents
from chunk_grpo.models.loading import load_flux_pipeline
from chunk_grpo.models.sampling_defaults import CONFIG_NAME, SamplingDefaults

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny-flux-shapes"


@dataclass
class PromptEmbeds:
    """Encoded prompts: T5 `prompt_embeds` [B, L, D], CLIP `pooled` [B, Dp], `text_ids` [L, 3]."""

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    text_ids: torch.Tensor

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def index(self, idx: torch.Tensor | list[int] | slice) -> PromptEmbeds:
        """Select rows (e.g. the prompts of a micro-batch)."""
        if isinstance(idx, list):
            idx = torch.tensor(idx, dtype=torch.long)
        return PromptEmbeds(self.prompt_embeds[idx], self.pooled[idx], self.text_ids)

    def repeat_interleave(self, n: int) -> PromptEmbeds:
        """Each prompt n times in a row: [p0, p0, ..., p1, p1, ...] (groups of n)."""
        if n < 1:
            raise ValueError(f"repeat_interleave needs n >= 1, got {n}")
        return PromptEmbeds(
            self.prompt_embeds.repeat_interleave(n, dim=0),
            self.pooled.repeat_interleave(n, dim=0),
            self.text_ids,
        )

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        if not parts:
            raise ValueError("PromptEmbeds.cat needs at least one part")
        return PromptEmbeds(
            torch.cat([p.prompt_embeds for p in parts]),
            torch.cat([p.pooled for p in parts]),
            parts[0].text_ids,
        )

    def to(self, device=None, dtype=None) -> PromptEmbeds:
        return PromptEmbeds(
            self.prompt_embeds.to(device=device, dtype=dtype),
            self.pooled.to(device=device, dtype=dtype),
            self.text_ids.to(device=device, dtype=dtype),
        )


class FluxPolicy:
    """A FLUX pipeline seen as a policy: encode prompts, velocity, initial noise, decode."""

    def __init__(self, pipeline: FluxPipeline, defaults: SamplingDefaults | None = None):
        self.pipeline = pipeline
        self.defaults = defaults or SamplingDefaults()
        self.height = self.defaults.height
        self.width = self.defaults.width
        self.max_sequence_length = self.defaults.max_sequence_length
        self.default_cfg_scale = self.defaults.default_cfg_scale
        self.guidance_scale = self.defaults.guidance_scale
        self.vae_scale_factor = 2 ** (len(pipeline.vae.config.block_out_channels) - 1)
        self.latent_channels = pipeline.transformer.config.in_channels // 4
        # Only the transformer is trained; the rest stays frozen.
        for module in (pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2):
            if module is not None:
                module.requires_grad_(False)
                module.eval()
        # The tiny models' word-level T5 vocabulary has no capitals: it can only read lowercase
        # text. A real T5 is case-sensitive and gets the prompt as written.
        tokenizer_2 = getattr(pipeline, "tokenizer_2", None)
        self.lowercase_t5 = tokenizer_2 is not None and reads_lowercase_only(tokenizer_2)
        self._negative: PromptEmbeds | None = None
        # The module velocity calls: the transformer, or its DDP wrapper (set after
        # parallelize_transformer). Attributes (config, dtype, adapters) are read on `transformer`.
        self.forward_module: torch.nn.Module | None = None
        self.sampling_file_found = False  # from_pretrained: the model had a chunk_grpo.json
        self.source: str | None = None  # from_pretrained: the path or hub id loaded
        # a chunk_grpo.models.prompt_cache.PromptCache, once prompts are cached
        self.prompt_cache = None
        self._freed_encoders: dict[str, type] = {}  # component name -> class, see free_...

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | os.PathLike = EMBEDDED_MODEL,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        frozen_dtype: torch.dtype | None = None,
        text_encoder_device: str | torch.device | None = None,
        transformer: torch.nn.Module | None = None,
        transformer_device: str | torch.device | None = None,
    ) -> FluxPolicy:
        """Load a FLUX pipeline as a policy.

        ``dtype``: the transformer's weights (fp32 when they are trained in full; the frozen base
        under LoRA may be bf16, its adapters are made fp32 by `prepare_transformer`).
        ``frozen_dtype``: the VAE and text encoders (default ``dtype``). Each part is loaded in
        its dtype straight to its device, never in fp32 first. ``text_encoder_device``: where
        the text encoders live (default ``device``; "cpu" keeps them off the GPU, their
        embeddings are moved to ``device``). ``transformer``: one to use instead of loading it
        (built on the ``meta`` device for sharded loading, `chunk_grpo.models.sharded_load`).
        ``transformer_device``: where the transformer loads (default ``device``; "cpu" for a
        base quantized as it moves to the device, `chunk_grpo.models.quantize`).
        """
        frozen_dtype = frozen_dtype or dtype
        dtypes = {"transformer": dtype, "default": frozen_dtype}
        encoders = text_encoder_device or device
        pipeline = load_flux_pipeline(
            path_or_id, dtype=dtypes, device=device, transformer=transformer,
            devices={"text_encoder": encoders, "text_encoder_2": encoders,
                     "transformer": transformer_device or device})
        local = Path(os.fspath(path_or_id)).expanduser()
        defaults = SamplingDefaults.load(local) if local.is_dir() else SamplingDefaults()
        policy = cls(pipeline, defaults)
        policy.sampling_file_found = (local / CONFIG_NAME).is_file()
        policy.source = str(local) if local.is_dir() else os.fspath(path_or_id)
        return policy

    def set_guidance(self, guidance: float | None) -> None:
        """The embedded guidance value of a guidance-distilled model (FLUX.1-dev: 3.5 by
        default); None keeps the model's default. A model without a guidance embedding would
        silently ignore it, so that is an error."""
        if guidance is None:
            return
        if not self.transformer.config.guidance_embeds:
            raise ValueError(f"guidance {guidance} is given but the model has no guidance "
                             f"embedding (it is not guidance-distilled) and would ignore it; "
                             f"remove guidance, or use cfg_scale for classifier-free guidance")
        self.guidance_scale = float(guidance)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def vae(self) -> torch.nn.Module:
        return self.pipeline.vae

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's compute dtype: that of its frozen weights (the base under LoRA,
        whose fp32 adapters cast their own input), else of its trained weights."""
        return compute_dtype(self.transformer)

    @property
    def has_text_encoders(self) -> bool:
        """False once `free_text_encoders` deleted them (prompts come from the cache)."""
        return self.pipeline.text_encoder is not None and self.pipeline.text_encoder_2 is not None

    def free_text_encoders(self) -> None:
        """Delete the text encoders from the pipeline (their memory is released); prompts are
        then looked up in ``prompt_cache``. `reload_text_encoders` brings them back."""
        for name in ("text_encoder", "text_encoder_2"):
            module = getattr(self.pipeline, name)
            if module is not None:
                self._freed_encoders[name] = type(module)
                setattr(self.pipeline, name, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload_text_encoders(self, device: str | torch.device = "cpu") -> None:
        """Load freed text encoders again from the model they came from (e.g. to export the
        pipeline), on ``device`` in the VAE's (the frozen parts') dtype."""
        for name, encoder_class in list(self._freed_encoders.items()):
            if self.source is None:
                raise ValueError("the text encoders were freed and the policy does not know "
                                 "its model path; load it with FluxPolicy.from_pretrained")
            module = encoder_class.from_pretrained(self.source, subfolder=name,
                                                   dtype=self.vae.dtype)
            module.requires_grad_(False).eval().to(device)
            # register_modules, not setattr: it also restores the model_index entry for saving.
            self.pipeline.register_modules(**{name: module})
            del self._freed_encoders[name]

    def latent_grid(self, height: int | None = None, width: int | None = None) -> tuple[int, int]:
        """Token grid (rows, columns) for an image size; FLUX packs 2x2 latent patches."""
        height, width = height or self.height, width or self.width
        step = self.vae_scale_factor * 2
        if height % step or width % step:
            raise ValueError(f"height and width must be multiples of {step}, got {height}x{width}")
        return height // step, width // step

    # ---- prompts -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Encode prompts once, on the transformer's device and in its dtype: by the text
        encoders, or from ``prompt_cache`` when they were freed (an uncached prompt is then an
        error naming it)."""
        if isinstance(prompts, str) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings")
        if self.has_text_encoders:
            raw = self.encode_with_text_encoders(prompts)
        elif self.prompt_cache is not None:
            raw = self.prompt_cache.load(prompts)
        else:
            raise ValueError("the text encoders were freed and there is no prompt cache; "
                             "call reload_text_encoders() or set a prompt_cache")
        return raw.to(device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def encode_with_text_encoders(self, prompts: list[str]) -> PromptEmbeds:
        """The text encoders' output for ``prompts``, on their device and in their dtype (what
        the prompt cache stores). CLIP's tokenizer lowercases by itself; T5 gets the prompt as
        written unless its vocabulary is lowercase only (the tiny models)."""
        return encode_text(self.pipeline, prompts, self.max_sequence_length, self.lowercase_t5)

    def negative_embeds(self, batch: int) -> PromptEmbeds:
        """The unconditional prompt (the caption-dropout target) repeated `batch` times."""
        if self._negative is None:
            self._negative = self.encode_prompts([self.defaults.negative_prompt])
        return self._negative.repeat_interleave(batch)

    # ---- latents -------------------------------------------------------------------------

    def initial_noise(
        self,
        batch: int,
        generator: torch.Generator | None = None,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """Packed Gaussian latents [B, N, C]: the draw FluxPipeline makes for this generator."""
        gh, gw = self.latent_grid(height, width)
        shape = (batch, self.latent_channels, gh * 2, gw * 2)
        gen_device = generator.device if generator is not None else self.device
        # fp32 whatever the weights: the sampler's state stays fp32 (the transformer casts).
        noise = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32)
        return pack_latents(noise.to(self.device))

    def _grid_for(self, n_tokens: int, height: int | None, width: int | None) -> tuple[int, int]:
        if height is not None or width is not None:
            grid = self.latent_grid(height, width)
        else:
            grid = self.latent_grid()
            if grid[0] * grid[1] != n_tokens:
                side = round(n_tokens**0.5)
                if side * side != n_tokens:
                    raise ValueError(
                        f"{n_tokens} latent tokens do not match the default {self.height}x"
                        f"{self.width} image; pass height= and width="
                    )
                grid = (side, side)
        if grid[0] * grid[1] != n_tokens:
            raise ValueError(f"latents have {n_tokens} tokens, but the image size gives {grid}")
        return grid

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor | float,
        embeds: PromptEmbeds,
        *,
        cfg_scale: float = 1.0,
        negative: PromptEmbeds | None = None,
        height: int | None = None,
        width: int | None = None,
        transformer: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """Flow velocity v [B, N, C] at noise level sigma [B] (1 = pure noise, 0 = clean).

        cfg_scale > 1 applies true classifier-free guidance against `negative` (default: the
        model's unconditional prompt): v = v_neg + cfg_scale * (v_cond - v_neg).
        ``transformer``: another transformer of the same model to evaluate (e.g. a frozen base
        copy, `chunk_grpo.models.hybrid_base`); default this policy's.
        """
        if latents.ndim != 3:
            raise ValueError(f"latents must be packed [B, N, C], got shape {tuple(latents.shape)}")
        b, n, _ = latents.shape
        if len(embeds) != b:
            raise ValueError(f"embeds has {len(embeds)} prompts for {b} latents; expand it first")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        sigma = sigma.expand(b) if sigma.ndim == 0 else sigma
        if sigma.shape != (b,):
            raise ValueError(
                f"sigma must be a scalar or have shape [{b}], got {tuple(sigma.shape)}"
            )
        transformer = self.transformer if transformer is None else transformer
        dtype = compute_dtype(transformer)
        ids = image_ids(self._grid_for(n, height, width), device=latents.device, dtype=dtype)
        x = latents.to(dtype)
        if cfg_scale != 1.0:
            negative = negative if negative is not None else self.negative_embeds(b)
            if len(negative) != b:
                raise ValueError(f"negative has {len(negative)} prompts for {b} latents")
            both = PromptEmbeds.cat([embeds, negative])
            out = self._forward(transformer, torch.cat([x, x]), torch.cat([sigma, sigma]), both,
                                ids)
            v_cond, v_neg = out[:b], out[b:]
            v = v_neg + cfg_scale * (v_cond - v_neg)
        else:
            v = self._forward(transformer, x, sigma, embeds, ids)
        return v.to(latents.dtype)

    def _forward(self, transformer, x, sigma, embeds: PromptEmbeds, ids) -> torch.Tensor:
        dtype = x.dtype
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full_like(sigma, self.guidance_scale)
        # The policy's own transformer runs through its DDP wrapper when it has one.
        wrapped = self.forward_module is not None and transformer is self.transformer
        call = self.forward_module if wrapped else transformer
        return call(
            hidden_states=x,
            # FLUX's transformer multiplies the timestep by 1000 itself: pass sigma in [0, 1].
            timestep=sigma.to(dtype),
            guidance=guidance,
            pooled_projections=embeds.pooled.to(dtype),
            encoder_hidden_states=embeds.prompt_embeds.to(dtype),
            txt_ids=embeds.text_ids.to(dtype),
            img_ids=ids,
            return_dict=False,
        )[0]

    # ---- pixels --------------------------------------------------------------------------

    @torch.no_grad()
    def decode(
        self, latents: torch.Tensor, height: int | None = None, width: int | None = None
    ) -> torch.Tensor:
        """Packed latents [B, N, C] -> images [B, 3, H, W] float32 in [0, 1]."""
        grid = self._grid_for(latents.shape[1], height, width)
        config = self.vae.config
        z = unpack_latents(latents.to(self.vae.dtype), grid)
        z = z / config.scaling_factor + config.shift_factor
        images = self.vae.decode(z, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None):
        """Images [B, 3, H, W] in [0, 1] -> packed, normalised latents [B, N, C] (posterior mode
        when generator is None, a posterior sample otherwise)."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [B, 3, H, W], got {tuple(images.shape)}")
        config = self.vae.config
        dist = self.vae.encode(images.to(self.vae.dtype) * 2 - 1).latent_dist
        z = dist.mode() if generator is None else dist.sample(generator)
        return pack_latents((z - config.shift_factor) * config.scaling_factor).to(self.dtype)


@torch.no_grad()
def encode_text(pipeline: FluxPipeline, prompts: list[str], max_sequence_length: int,
                lowercase_t5: bool) -> PromptEmbeds:
    """The pipeline's text encoders' output for ``prompts``, on their device and in their dtype
    (`FluxPolicy.encode_with_text_encoders`; needs no transformer or VAE). Never under the
    caller's autocast: the unconditional prompt is first encoded inside a transformer call,
    and its cached embedding must not depend on which call that was."""
    t5_prompts = [p.lower() for p in prompts] if lowercase_t5 else list(prompts)
    device = pipeline.text_encoder_2.device
    with torch.autocast(device.type, enabled=False):
        embeds, pooled, text_ids = pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=t5_prompts,
            device=device,
            max_sequence_length=max_sequence_length,
        )
    return PromptEmbeds(embeds, pooled, text_ids)


def compute_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The dtype a transformer computes in: that of its first frozen parameter (the base
    weights under LoRA), or of its first parameter when all are trained."""
    first = None
    for param in transformer.parameters():
        if not param.requires_grad:
            return param.dtype
        first = first or param.dtype
    return first or torch.float32
