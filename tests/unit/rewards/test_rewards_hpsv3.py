"""The `hpsv3` reward on a tiny random Qwen2-VL saved in the authors' checkpoint layout
(tests/hpsv3_tiny.py), loaded through the registry and compared with the authors' forward
recomputed by hand."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hpsv3_tiny import (
    PROMPTS,
    PUBLISHED_PREPROCESSOR,
    QWEN2_VL_TEMPLATE,
    SPECIALS,
    authors_state_dict,
    save_tiny_hpsv3,
    tiny_tokenizer,
)
from PIL import Image
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2TokenizerFast

from chunk_grpo.rewards import get_reward
from chunk_grpo.rewards import hpsv3 as hps
from chunk_grpo.rewards.hpsv3_checkpoint import HPSv3LoadError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory in the authors' layout, reference model, reference head, tokenizer)."""
    root = tmp_path_factory.mktemp("hpsv3")
    return (root, *save_tiny_hpsv3(root))


def _images(n: int, size: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _reference_scores(tiny, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The authors' forward, one image at a time, on the in-memory model: embeddings with the
    image features scattered in, the decoder with no position ids, the head at <|Reward|>."""
    _, model, head, tokenizer = tiny
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    reward_id = tok.convert_tokens_to_ids("<|Reward|>")
    scores = []
    for image, prompt in zip(images, prompts, strict=True):
        pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        pil = Image.fromarray(pixels).resize((448, 448), Image.BICUBIC)  # 256*28*28 pixels
        x = (np.asarray(pil, dtype=np.float32) / 255 - PUBLISHED_PREPROCESSOR["image_mean"]) \
            / PUBLISHED_PREPROCESSOR["image_std"]
        patches = torch.from_numpy(x.astype(np.float32)).permute(2, 0, 1)  # C, 448, 448
        # Qwen2-VL patch order: (16 merged rows, 16 merged cols, 2, 2) of (C, 2 frames, 14, 14).
        p = patches.reshape(3, 16, 2, 14, 16, 2, 14).permute(1, 4, 2, 5, 0, 3, 6)
        p = p.unsqueeze(5).expand(16, 16, 2, 2, 3, 2, 14, 14).reshape(1024, 3 * 2 * 14 * 14)
        text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|>" + "<|image_pad|>" * 256 + "<|vision_end|>"
                + hps.INSTRUCTION.replace("{text_prompt}", prompt)
                + "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
                + "<|im_end|>\n<|im_start|>assistant\n")
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            embeds = model.model.language_model.embed_tokens(ids)
            features = model.model.visual(p, grid_thw=torch.tensor([[1, 32, 32]])).pooler_output
            mask = (ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, features)
            hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state
            scores.append(head(hidden[ids == reward_id])[0, 0])
    return torch.stack(scores)


def test_scores_equal_the_authors_forward_recomputed_by_hand(tiny):
    reward = get_reward("hpsv3", model=str(tiny[0]), batch_size=3)
    images = _images(3)
    scores = reward(images, PROMPTS)
    assert scores.dtype == torch.float32 and scores.shape == (3,) and scores.device.type == "cpu"
    assert {p.dtype for p in reward.backbone.parameters()} == {torch.float32}  # fp32 on the CPU
    torch.testing.assert_close(scores, _reference_scores(tiny, images, PROMPTS),
                               rtol=1e-4, atol=1e-5)
    assert scores.std() > 1e-4  # the images and prompts do change the score


def test_deterministic_and_batch_invariant(tiny):
    images = _images(3, seed=2)
    by_three = get_reward("hpsv3", model=tiny[0], batch_size=3)
    by_one = get_reward("hpsv3", model=tiny[0], batch_size=1)
    first = by_three(images, PROMPTS)
    assert torch.equal(first, by_three(images, PROMPTS))
    torch.testing.assert_close(first, by_one(images, PROMPTS), rtol=1e-5, atol=1e-6)


def test_positions_are_the_authors_plain_ones_not_3d_mrope(tiny):
    """The authors call the decoder without position ids: 0..L-1 on all three M-RoPE axes, where
    transformers' default forward would give the image tokens 2D grid positions."""
    reward = get_reward("hpsv3", model=tiny[0])
    seen = []
    hook = reward.backbone.language_model.rotary_emb.register_forward_hook(
        lambda module, args, out: seen.append(args[1].clone()))
    try:
        reward(_images(2), PROMPTS[:2])
        inputs = reward.preprocess(_images(1), PROMPTS[:1])
        mm_types = (inputs["input_ids"] == tiny[1].config.image_token_id).int()
        with torch.no_grad():
            reward.backbone(**inputs, mm_token_type_ids=mm_types)  # transformers' default
    finally:
        hook.remove()
    ours, default = seen
    length = ours.shape[-1]
    assert torch.equal(ours, torch.arange(length).expand(3, 2, length))
    assert not torch.equal(default, torch.arange(default.shape[-1]).expand_as(default))


def test_preprocessing_matches_the_published_constants(tiny):
    assert hps.PIXELS == 256 * 28 * 28 == 200704  # min_pixels = max_pixels in HPSv3_7B.yaml
    assert hps.smart_resize(64, 64) == (448, 448)
    # 512x1024: 504x1036 is over the budget; scaled by sqrt(512*1024/200704), floored to 28s
    assert hps.smart_resize(512, 1024) == (308, 616)
    reward = get_reward("hpsv3", model=tiny[0])
    proc = reward.image_processor
    assert tuple(proc.image_mean) == (0.48145466, 0.4578275, 0.40821073)
    assert tuple(proc.image_std) == (0.26862954, 0.26130258, 0.27577711)
    assert (proc.patch_size, proc.merge_size, proc.temporal_patch_size) == (14, 2, 2)
    inputs = reward.preprocess(_images(2), PROMPTS[:2])
    assert inputs["image_grid_thw"].tolist() == [[1, 32, 32]] * 2
    assert int((inputs["input_ids"] == tiny[1].config.image_token_id).sum()) == 2 * 256
    text = reward.tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=False)
    assert text.replace("<|endoftext|>", "").endswith(
        "Textual prompt - a red circle\n\n\n\nPlease provide the overall ratings of this image: "
        "<|Reward|>\n\nEND\n<|im_end|>\n<|im_start|>assistant\n")
    # the tokenizer's own (published) chat template renders exactly the text we feed
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": hps.user_text("x")}]}]
    assert tiny[3].apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        hps.conversation_text("x")


def _copy(tiny, tmp_path, drop=()):
    target = tmp_path / "model"
    shutil.copytree(tiny[0], target)
    for name in drop:
        (target / name).unlink()
    return target


def test_missing_directory_and_files_are_one_line_errors(tiny, tmp_path):
    with pytest.raises(HPSv3LoadError, match=r"does not exist.*hf download MizzenAI/HPSv3") as err:
        get_reward("hpsv3", model=str(tmp_path / "nowhere"))
    assert "\n" not in str(err.value)  # one line for the CLI's `prog: error: ...`
    with pytest.raises(HPSv3LoadError, match=r"has no HPSv3\.safetensors"):
        get_reward("hpsv3", model=_copy(tiny, tmp_path, drop=["HPSv3.safetensors"]))
    shutil.rmtree(tmp_path / "model")
    with pytest.raises(HPSv3LoadError, match=r"lacks the Qwen2-VL files preprocessor_config"):
        get_reward("hpsv3", model=_copy(tiny, tmp_path, drop=["preprocessor_config.json"]))
    shutil.rmtree(tmp_path / "model")
    with pytest.raises(HPSv3LoadError, match=r"lacks the Qwen2-VL files tokenizer\.json"):
        get_reward("hpsv3", model=_copy(tiny, tmp_path, drop=["tokenizer.json"]))


def test_hub_id_resolves_from_the_cache_only(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HPSv3LoadError, match=r"not in the local Hugging Face cache"):
        get_reward("hpsv3", model="MizzenAI/HPSv3")
    # a cached snapshot (the hub cache layout) loads without any network
    cache = tmp_path / "cache"
    for repo, files in (("MizzenAI/HPSv3", ["HPSv3.safetensors"]),
                        ("Qwen/Qwen2-VL-7B-Instruct", [p.name for p in tiny[0].iterdir()
                                                       if p.name != "HPSv3.safetensors"])):
        repo_dir = cache / ("models--" + repo.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / "main").write_text("0" * 40)
        for name in files:
            shutil.copy(tiny[0] / name, snapshot / name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    images = _images(1)
    torch.testing.assert_close(get_reward("hpsv3", model="MizzenAI/HPSv3")(images, PROMPTS[:1]),
                               get_reward("hpsv3", model=tiny[0])(images, PROMPTS[:1]))


def test_tokenizer_that_does_not_match_the_model_is_an_error(tiny, tmp_path):
    target = _copy(tiny, tmp_path)
    grown = tiny_tokenizer()
    grown.add_tokens(["<|extra|>"])  # one token more than the checkpoint's embedding
    grown.save_pretrained(target)
    with pytest.raises(HPSv3LoadError, match=r"tokens with <\|Reward\|> but the checkpoint's "
                                             r"embedding has \d+ rows"):
        get_reward("hpsv3", model=target)


def test_another_chat_template_is_an_error(tiny, tmp_path):
    target = _copy(tiny, tmp_path)
    other = tiny_tokenizer()
    other.chat_template = QWEN2_VL_TEMPLATE.replace("You are a helpful assistant.", "Be brief.")
    other.save_pretrained(target)
    with pytest.raises(HPSv3LoadError, match=r"chat template is not Qwen2-VL-7B-Instruct's"):
        get_reward("hpsv3", model=target)


def test_tokenizer_without_the_vision_tokens_is_an_error(tiny, tmp_path):
    target = _copy(tiny, tmp_path)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS[:3], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(PROMPTS, trainer)
    Qwen2TokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                       unk_token=None, bos_token=None).save_pretrained(target)
    with pytest.raises(HPSv3LoadError, match=r"has no special token <\|vision_start\|>"):
        get_reward("hpsv3", model=target)


def test_wrong_preprocessing_or_checkpoint_keys_are_errors(tiny, tmp_path):
    target = _copy(tiny, tmp_path)
    (target / "preprocessor_config.json").write_text(
        json.dumps({**PUBLISHED_PREPROCESSOR, "image_mean": [0.5, 0.5, 0.5]}))
    with pytest.raises(HPSv3LoadError, match=r"HPSv3 needs .*preprocessor_config\.json"):
        get_reward("hpsv3", model=target)
    (target / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_PREPROCESSOR))
    state = authors_state_dict(tiny[1], tiny[2])
    del state["rm_head.5.weight"]
    save_file(state, str(target / "HPSv3.safetensors"))
    with pytest.raises(HPSv3LoadError, match=r"missing \['head\.5\.weight'\]"):
        get_reward("hpsv3", model=target)


def test_bad_inputs_are_clear_errors(tiny):
    reward = get_reward("hpsv3", model=tiny[0])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(torch.rand(3, 64, 64), ["a"])
    with pytest.raises(ValueError, match=r"2 images but 1 prompts"):
        reward(_images(2), ["a"])
    with pytest.raises(ValueError, match=r"contains the text <\|Reward\|>"):
        reward(_images(1), ["a <|Reward|> b"])


def test_bf16_backbone_keeps_an_fp32_head_and_scores_close_to_fp32(tiny):
    """The authors' dtype split: bf16 backbone, fp32 head (on the hidden state upcast)."""
    reward = get_reward("hpsv3", model=tiny[0], dtype="bfloat16")
    assert {p.dtype for p in reward.backbone.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in reward.head.parameters()} == {torch.float32}
    images = _images(2)
    scores = reward(images, PROMPTS[:2])
    assert scores.dtype == torch.float32
    full = get_reward("hpsv3", model=tiny[0])(images, PROMPTS[:2])
    torch.testing.assert_close(scores, full, rtol=0.05, atol=2e-3)
