"""A randomly initialised FLUX pipeline small enough for a CPU, built without any download.

Every component is the class FLUX.1-dev uses (FluxTransformer2DModel, AutoencoderKL, CLIPTextModel,
T5EncoderModel, FlowMatchEulerDiscreteScheduler), so `FluxPipeline.save_pretrained` /
`from_pretrained` and the rest of the project treat it exactly like the real model. The two
tokenizers are built from a word list: a word-level T5 unigram vocabulary and a CLIP byte-level BPE
learned on the words (whole words become single tokens; unknown words still tokenize into bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

CLIP_MAX_LENGTH = 77
_CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")


@dataclass(frozen=True)
class TinyFluxSizes:
    """Sizes of every component; the defaults are the shipped shapes model."""

    num_layers: int = 2  # double-stream (MMDiT) blocks
    num_single_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    axes_dims_rope: tuple[int, int, int] = (8, 12, 12)  # sums to attention_head_dim
    vae_block_out_channels: tuple[int, ...] = (32, 64, 64)  # 3 levels -> 4x downsampling
    vae_layers_per_block: int = 1
    vae_norm_num_groups: int = 16
    latent_channels: int = 4
    vae_scaling_factor: float = 1.0  # FLUX.1-dev's VAE: 0.3611
    vae_shift_factor: float = 0.0  # FLUX.1-dev's VAE: 0.1159
    vae_mid_block_attention: bool = False  # FLUX.1-dev's VAE has one
    t5_d_model: int = 64
    t5_layers: int = 1
    t5_heads: int = 4
    t5_d_kv: int = 0  # per-head width; 0 = t5_d_model // t5_heads (a wide d_model stays cheap)
    t5_d_ff: int = 128
    clip_hidden: int = 64
    clip_layers: int = 1
    clip_heads: int = 4
    clip_intermediate: int = 128
    guidance_embeds: bool = False  # True = FLUX.1-dev's guidance-distilled conditioning


def _sizes_from_kwargs(sizes: dict) -> TinyFluxSizes:
    known = {f.name for f in fields(TinyFluxSizes)}
    unknown = sorted(set(sizes) - known)
    if unknown:
        raise ValueError(f"unknown size argument(s) {unknown}; valid names: {sorted(known)}")
    result = TinyFluxSizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in sizes.items()})
    if sum(result.axes_dims_rope) != result.attention_head_dim:
        raise ValueError(
            f"axes_dims_rope {result.axes_dims_rope} must sum to attention_head_dim "
            f"{result.attention_head_dim}"
        )
    return result


def _clean_vocabulary(vocabulary: list[str]) -> list[str]:
    if not vocabulary:
        raise ValueError("vocabulary is empty; pass the list of words prompts can contain")
    words = []
    for word in vocabulary:
        if not isinstance(word, str) or not word.strip() or any(c.isspace() for c in word.strip()):
            raise ValueError(f"vocabulary entries must be single non-empty words, got {word!r}")
        words.append(word.strip().lower())
    return sorted(set(words))


def build_t5_tokenizer(vocabulary: list[str]) -> T5Tokenizer:
    """Word-level T5 tokenizer: <pad>=0, </s>=1, <unk>=2, then one token per word (lowercase)."""
    words = _clean_vocabulary(vocabulary)
    # Equal scores: every listed word is one piece; an unknown word becomes one <unk>.
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + w, -1.0) for w in words]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _learn_bpe_merges(words: list[str]) -> list[tuple[str, str]]:
    """Classic BPE on the word list until every word is one symbol; ties broken by the pair
    itself, so the merges (and token ids) are the same on every run. (The `tokenizers` trainer
    breaks ties in hash order.)"""
    corpus = [list(w[:-1]) + [w[-1] + "</w>"] for w in words]
    merges = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for symbols in corpus:
            for pair in zip(symbols[:-1], symbols[1:], strict=True):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        for i, symbols in enumerate(corpus):
            merged, j = [], 0
            while j < len(symbols):
                if j + 1 < len(symbols) and (symbols[j], symbols[j + 1]) == best:
                    merged.append(symbols[j] + symbols[j + 1])
                    j += 2
                else:
                    merged.append(symbols[j])
                    j += 1
            corpus[i] = merged


def build_clip_tokenizer(vocabulary: list[str]) -> CLIPTokenizer:
    """CLIP byte-level BPE whose merges make each known word a single token."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    words = [byte_level.pre_tokenize_str(w)[0][0] for w in _clean_vocabulary(vocabulary)]
    merges = _learn_bpe_merges(words)
    # CLIP's layout: single bytes, single bytes ending a word, merges in rank order, specials.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    tokens += list(_CLIP_SPECIALS)
    vocab = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)
    for word in vocabulary:
        if len(tokenizer.tokenize(word)) != 1:
            raise RuntimeError(f"CLIP BPE did not learn {word!r} as a single token")
    return tokenizer


def build_tiny_flux_pipeline(vocabulary: list[str], *, seed: int = 0, **sizes) -> FluxPipeline:
    """A randomly initialised FLUX pipeline with tokenizers for `vocabulary` (see TinyFluxSizes)."""
    s = _sizes_from_kwargs(sizes)
    tokenizer = build_clip_tokenizer(vocabulary)
    tokenizer_2 = build_t5_tokenizer(vocabulary)
    torch.manual_seed(seed)

    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.clip_hidden,
        intermediate_size=s.clip_intermediate,
        num_hidden_layers=s.clip_layers,
        num_attention_heads=s.clip_heads,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=s.clip_hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = CLIPTextModel(clip_config)

    t5_config = T5Config(
        vocab_size=len(tokenizer_2),
        d_model=s.t5_d_model,
        d_kv=s.t5_d_kv or s.t5_d_model // s.t5_heads,
        d_ff=s.t5_d_ff,
        num_layers=s.t5_layers,
        num_heads=s.t5_heads,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
    )
    text_encoder_2 = T5EncoderModel(t5_config)

    levels = len(s.vae_block_out_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=s.vae_block_out_channels,
        layers_per_block=s.vae_layers_per_block,
        latent_channels=s.latent_channels,
        norm_num_groups=s.vae_norm_num_groups,
        sample_size=64,
        scaling_factor=s.vae_scaling_factor,
        shift_factor=s.vae_shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=s.vae_mid_block_attention,
    )

    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * s.latent_channels,
        num_layers=s.num_layers,
        num_single_layers=s.num_single_layers,
        attention_head_dim=s.attention_head_dim,
        num_attention_heads=s.num_attention_heads,
        joint_attention_dim=s.t5_d_model,
        pooled_projection_dim=s.clip_hidden,
        guidance_embeds=s.guidance_embeds,
        axes_dims_rope=s.axes_dims_rope,
    )
    # Fixed shift 3 (the schedule of docs/math.md): the pipeline samples with the sigmas the
    # trainer uses.
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)

    pipeline = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipeline.tiny_sizes = asdict(s)
    return pipeline
