"""`hpsv2`: an open_clip-format checkpoint (written by the test from a tiny CLIPModel with an
inverse mapping of its own) converted back into a CLIPModel and scored as the HPSv2 authors do:
cos of the normalised embeddings, no logit scale."""

import huggingface_hub.constants
import pytest
import torch
from reward_models_tiny import (
    OPENAI_MEAN,
    OPENAI_STD,
    open_clip_state_dict,
    save_processor,
    tiny_clip_model,
)
from transformers import AutoTokenizer

from chunk_grpo.rewards import RewardLoadError, get_reward
from chunk_grpo.rewards.hpsv2 import HPSV21_FILE, VIT_H_14_PROCESSOR
from chunk_grpo.rewards.open_clip_convert import (
    OpenClipConversionError,
    convert_open_clip_state_dict,
)

PROMPTS = ["a red circle", "a blue square", "a red circle", "two green triangles",
           "a small yellow circle on the left", "a blue square", "a red circle"]
HEADS = (2, 2)  # the tiny model's; ViT-H-14's (16, 16) are the default


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """(original CLIPModel, directory holding HPS_v2.1_compressed.pt, processor directory)."""
    root = tmp_path_factory.mktemp("hps")
    model = tiny_clip_model(hidden_act="gelu", seed=3)  # open_clip's ViT-H-14 uses exact GELU
    (root / "ckpt").mkdir()
    torch.save({"state_dict": open_clip_state_dict(model)}, root / "ckpt" / HPSV21_FILE)
    return model, root / "ckpt", save_processor(root / "processor", image_size=32)


def _reference(model, processor_dir, images, prompts):
    """HPS by hand on the original model: diag(normalised image @ normalised text.T)."""
    tokenizer = AutoTokenizer.from_pretrained(processor_dir)
    pixels = (images - torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)) / torch.tensor(
        OPENAI_STD).view(1, 3, 1, 1)
    tokens = tokenizer(prompts, padding="max_length", max_length=77, truncation=True,
                       return_tensors="pt")
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels)
        text = model.get_text_features(input_ids=tokens.input_ids,
                                       attention_mask=tokens.attention_mask)
    image = image if torch.is_tensor(image) else image.pooler_output
    text = text if torch.is_tensor(text) else text.pooler_output
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    return torch.diagonal(image @ text.T)


def test_round_trip_gives_the_original_weights(tiny_hps):
    model, _, _ = tiny_hps
    converted = convert_open_clip_state_dict(open_clip_state_dict(model))
    original = model.state_dict()
    assert set(converted) == set(original)
    for key, value in original.items():
        torch.testing.assert_close(converted[key], value, rtol=0, atol=0, msg=key)


def test_hpsv2_scores_equal_the_original_model(tiny_hps):
    model, checkpoint_dir, processor = tiny_hps
    torch.manual_seed(0)
    images = (torch.rand(7, 3, 32, 32) * 255).round() / 255  # 8-bit images, as PIL's
    reward = get_reward("hpsv2", model=checkpoint_dir, processor=processor, heads=HEADS)
    scores = reward(images, PROMPTS)
    expected = _reference(model, processor, images, PROMPTS)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    assert scores.abs().max() <= 1.0  # a cosine: no logit scale
    # Deterministic and batch-invariant (float32 rounding of other batch shapes aside).
    one = get_reward("hpsv2", model=checkpoint_dir / HPSV21_FILE, processor=processor,
                     heads=HEADS, batch_size=1)(images, PROMPTS)
    torch.testing.assert_close(one, scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reward(images, PROMPTS), scores, rtol=0, atol=0)


def test_head_count_that_does_not_divide_the_width_is_refused(tiny_hps):
    """Head counts are not in a state dict (the default is ViT-H-14's): one that cannot split
    the width is refused."""
    _, checkpoint_dir, processor = tiny_hps
    with pytest.raises(RewardLoadError, match="not divisible by 3 heads"):
        get_reward("hpsv2", model=checkpoint_dir, processor=processor, heads=(3, 2))


def test_unknown_keys_and_missing_files_are_errors(tiny_hps, tmp_path):
    model, checkpoint_dir, processor = tiny_hps
    state = open_clip_state_dict(model)
    state["visual.transformer.resblocks.0.ls_1.gamma"] = torch.ones(32)  # layer scale
    with pytest.raises(OpenClipConversionError, match="ls_1"):
        convert_open_clip_state_dict(state)
    with pytest.raises(RewardLoadError, match=HPSV21_FILE):
        get_reward("hpsv2", model=tmp_path, processor=processor, heads=HEADS)
    with pytest.raises(RewardLoadError, match=f"{HPSV21_FILE} of 'xswu/HPSv2'"):
        get_reward("hpsv2", processor=processor, heads=HEADS)  # default: the hub repo, uncached
    with pytest.raises(RewardLoadError, match=VIT_H_14_PROCESSOR):
        get_reward("hpsv2", model=checkpoint_dir, heads=HEADS)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(RewardLoadError, match="garbage.pt"):
        get_reward("hpsv2", model=garbage, processor=processor, heads=HEADS)


def test_tokenizer_of_another_vocabulary_is_refused(tiny_hps, tmp_path):
    _, checkpoint_dir, processor = tiny_hps
    other = tmp_path / "processor"
    other.mkdir()
    for f in processor.iterdir():
        if f.name != "tokenizer.json":
            (other / f.name).write_bytes(f.read_bytes())
    with pytest.raises(RewardLoadError, match="2 tokens"):
        get_reward("hpsv2", model=checkpoint_dir, processor=other, heads=HEADS)
