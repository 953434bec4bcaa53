"""Prompts reach a real (cased) T5 as written; the tiny word-level T5 gets them lowercased."""

import torch
from trainer_utils import TINY_DEFAULTS, TINY_SIZES
from transformers import T5Tokenizer

from chunk_grpo.data.prompts import reads_lowercase_only
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.tiny import build_tiny_flux_pipeline

WORDS = ["a", "cat", "red"]


def test_a_cased_t5_gets_the_prompt_as_written():
    # Room in the T5 embedding table for the cased vocabulary below.
    pipeline = build_tiny_flux_pipeline(WORDS + ["one", "two", "blue", "square"], **TINY_SIZES)
    lower_only = FluxPolicy(pipeline, TINY_DEFAULTS)  # the tiny word-level T5: lowercase only
    assert lower_only.lowercase_t5
    same = [lower_only.encode_prompts([p]).prompt_embeds for p in ("A Cat", "a cat")]
    torch.testing.assert_close(same[0], same[1], rtol=0, atol=0)

    # A T5 vocabulary with capitals, as a real T5 has ("▁The", "▁A", ...).
    pieces = ["a", "A", "cat", "Cat", "red"]
    cased = T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
                        + [("\u2581" + w, -1.0) for w in pieces], extra_ids=0)
    pipeline.tokenizer_2 = cased
    policy = FluxPolicy(pipeline, TINY_DEFAULTS)
    assert not policy.lowercase_t5 and not reads_lowercase_only(cased)
    upper, lower = (policy.encode_prompts([p]) for p in ("A Cat", "a cat"))
    assert (upper.prompt_embeds - lower.prompt_embeds).abs().max() > 1e-3
    torch.testing.assert_close(upper.pooled, lower.pooled)  # CLIP lowercases by itself
    ids = cased("A Cat").input_ids
    assert ids != cased("a cat").input_ids and cased.unk_token_id not in ids
