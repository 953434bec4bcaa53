"""The tiny FLUX pipeline: tokenizers built from words, components, and the diffusers round trip."""

import pytest
import torch
from diffusers import FluxPipeline
from trainer_utils import TINY_SIZES

from chunk_grpo.models.tiny import (
    build_clip_tokenizer,
    build_t5_tokenizer,
    build_tiny_flux_pipeline,
)

WORDS = (
    "a one two three red green blue yellow circle circles square squares triangle triangles "
    "small big left right above below of and"
).split()


def test_t5_tokenizer_maps_each_word_to_one_token():
    tok = build_t5_tokenizer(WORDS)
    ids = tok("two red circles above a blue square").input_ids
    assert len(ids) == 7 + 1 and ids[-1] == tok.eos_token_id
    assert tok.unk_token_id not in ids
    assert len(set(ids)) == len(ids)
    assert tok("zebra").input_ids == [tok.unk_token_id, tok.eos_token_id]


def test_clip_tokenizer_knows_words_and_still_covers_unknown_text():
    tok = build_clip_tokenizer(WORDS)
    assert tok.model_max_length == 77
    ids = tok("Two RED circles").input_ids  # CLIP lowercases itself
    assert ids == [tok.bos_token_id, *tok("two red circles").input_ids[1:-1], tok.eos_token_id]
    assert len(ids) == 5
    # An unknown word falls back to byte pieces, never to a single unknown token.
    pieces = tok.tokenize("zebra")
    assert len(pieces) > 1 and tok.unk_token_id not in tok.convert_tokens_to_ids(pieces)


def test_bad_vocabulary_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="vocabulary"):
        build_t5_tokenizer([])
    with pytest.raises(ValueError, match="single non-empty words"):
        build_t5_tokenizer(["red", "two words"])
    with pytest.raises(ValueError, match="unknown size"):
        build_tiny_flux_pipeline(WORDS, hidden=3)
    with pytest.raises(ValueError, match="axes_dims_rope"):
        build_tiny_flux_pipeline(WORDS, attention_head_dim=16, axes_dims_rope=(4, 4, 4))


def test_pipeline_is_flux_and_seeded():
    a = build_tiny_flux_pipeline(WORDS, seed=3, **TINY_SIZES)
    b = build_tiny_flux_pipeline(WORDS, seed=3, **TINY_SIZES)
    c = build_tiny_flux_pipeline(WORDS, seed=4, **TINY_SIZES)
    assert isinstance(a, FluxPipeline)
    wa, wb, wc = (p.transformer.x_embedder.weight for p in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    # CLIP pools at the end-of-text token: the config must use the tokenizer's id.
    assert a.text_encoder.config.eos_token_id == a.tokenizer.eos_token_id
    assert a.transformer.config.joint_attention_dim == a.text_encoder_2.config.d_model
    assert a.transformer.config.pooled_projection_dim == a.text_encoder.config.hidden_size
    assert a.transformer.config.in_channels == 4 * a.vae.config.latent_channels
    assert a.scheduler.config.shift == 3.0 and not a.scheduler.config.use_dynamic_shifting


def test_save_and_reload_offline_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = build_tiny_flux_pipeline(WORDS, seed=1, **TINY_SIZES)
    pipe.save_pretrained(tmp_path)
    loaded = FluxPipeline.from_pretrained(tmp_path, local_files_only=True)
    prompt = "three green triangles left of a small square"
    assert loaded.tokenizer(prompt).input_ids == pipe.tokenizer(prompt).input_ids
    assert loaded.tokenizer_2(prompt).input_ids == pipe.tokenizer_2(prompt).input_ids
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        want, got = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), name
    kw = dict(height=32, width=32, num_inference_steps=2, max_sequence_length=16)
    kw["output_type"] = "latent"
    out_a = pipe(prompt, generator=torch.Generator().manual_seed(0), **kw).images
    out_b = loaded(prompt, generator=torch.Generator().manual_seed(0), **kw).images
    # Bit-identical weights (checked above); the outputs may differ in the last bit (4.8e-7 seen
    # with diffusers 0.42: CPU kernels pick paths by memory alignment), never more.
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=2e-6)
