"""`imagereward`: a tiny random BLIP of ImageReward's architecture, written by this test in the
authors' ImageReward.pt key layout (an inverse mapping of its own), with a med_config.json and an
offline BERT WordPiece tokenizer; scores must equal a recomputation by hand on the original
modules: [CLS]-position output of the cross-attending text encoder -> MLP -> (r - mean) / std."""

import json

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import (
    AutoTokenizer,
    BertTokenizerFast,
    BlipTextConfig,
    BlipTextModel,
    BlipVisionConfig,
    BlipVisionModel,
)

from chunk_grpo.rewards import RewardLoadError, get_reward
from chunk_grpo.rewards.imagereward import (
    CHECKPOINT_FILE,
    MAX_LENGTH,
    MED_CONFIG_FILE,
    REWARD_MEAN,
    REWARD_STD,
    imagereward_preprocess,
)

PROMPTS = ["a red circle", "a blue square", "a red circle", "two green triangles",
           "a small yellow circle on the left"]
WORDS = ["a", "red", "blue", "circle", "square", "two", "green", "triangle", "##s", "small",
         "yellow", "on", "the", "left"]
VISION_WIDTH, TEXT_WIDTH, IMAGE_SIZE, PATCH = 48, 32, 32, 8
VISION_HEADS = 2


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def save_bert_tokenizer(path, words=WORDS):
    """A BERT WordPiece tokenizer (lower-cased, [CLS] ... [SEP]) like bert-base-uncased's."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + list("abcdefghijklmnopqrstuvwxyz")
                                                      + words))}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = BertTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]",
                                  pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                                  model_max_length=512)
    tokenizer.save_pretrained(path)
    return path, len(vocab)


def tiny_blip(vocab_size: int, seed: int = 0):
    """(vision, text, head) of ImageReward's architecture, tiny, with random weights of a scale
    that makes every part matter."""
    torch.manual_seed(seed)
    vision = BlipVisionModel(BlipVisionConfig(
        hidden_size=VISION_WIDTH, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=VISION_HEADS, image_size=IMAGE_SIZE, patch_size=PATCH,
        hidden_act="gelu", layer_norm_eps=1e-6)).eval()
    text = BlipTextModel(BlipTextConfig(
        vocab_size=vocab_size, hidden_size=TEXT_WIDTH, encoder_hidden_size=VISION_WIDTH,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=40, is_decoder=True, bos_token_id=None, sep_token_id=None),
        add_pooling_layer=False).eval()
    head = nn.Sequential(nn.Linear(TEXT_WIDTH, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                         nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1),
                         nn.Linear(64, 16), nn.Linear(16, 1)).eval()
    with torch.no_grad():
        for module in (vision, text, head):
            for param in module.parameters():
                param.normal_(0.0, 0.3)
    return vision, text, head


def authors_state_dict(vision, text, head) -> dict[str, torch.Tensor]:
    """The ImageReward.pt layout (names of BLIP's VisionTransformer, med BertModel and the MLP
    in ImageReward's module), written independently of the converter."""
    out = {}
    for key, value in vision.state_dict().items():
        key = (key.replace("embeddings.class_embedding", "cls_token")
               .replace("embeddings.position_embedding", "pos_embed")
               .replace("embeddings.patch_embedding", "patch_embed.proj")
               .replace("post_layernorm", "norm")
               .replace("encoder.layers.", "blocks.")
               .replace("layer_norm1", "norm1").replace("layer_norm2", "norm2")
               .replace("self_attn.qkv", "attn.qkv").replace("self_attn.projection", "attn.proj"))
        out["blip.visual_encoder." + key] = value
    for key, value in text.state_dict().items():
        out["blip.text_encoder." + key] = value
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(40).unsqueeze(0)
    for index, module in enumerate(head):
        if isinstance(module, nn.Linear):
            out[f"mlp.layers.{index}.weight"] = module.weight
            out[f"mlp.layers.{index}.bias"] = module.bias
    out["blip.vision_proj.weight"] = torch.randn(16, VISION_WIDTH)  # unused by the score
    out["blip.vision_proj.bias"] = torch.randn(16)
    out["blip.text_proj.weight"] = torch.randn(16, TEXT_WIDTH)
    out["blip.text_proj.bias"] = torch.randn(16)
    return {k: v.detach().clone() for k, v in out.items()}


def med_config(vocab_size: int) -> dict:
    """The authors' med_config.json, at the tiny sizes (encoder_width stays 768 as in the
    original file: ImageReward overrides it with the ViT width)."""
    return {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1,
            "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": TEXT_WIDTH,
            "initializer_range": 0.02, "intermediate_size": 64, "layer_norm_eps": 1e-12,
            "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 4,
            "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2,
            "vocab_size": vocab_size, "encoder_width": 768, "add_cross_attention": True}


@pytest.fixture(scope="module")
def tiny_ir(tmp_path_factory):
    """(vision, text, head, checkpoint directory, tokenizer directory)."""
    root = tmp_path_factory.mktemp("imagereward")
    tokenizer_dir, n_words = save_bert_tokenizer(root / "bert")
    vocab_size = n_words + 2  # + [DEC] + [ENC]
    vision, text, head = tiny_blip(vocab_size)
    (root / "ckpt").mkdir()
    torch.save(authors_state_dict(vision, text, head), root / "ckpt" / CHECKPOINT_FILE)
    (root / "ckpt" / MED_CONFIG_FILE).write_text(json.dumps(med_config(vocab_size)))
    return vision, text, head, root / "ckpt", tokenizer_dir


def _reference(vision, text, head, tokenizer_dir, images, prompts):
    """ImageReward.score by hand: CLIP-normalised 224-style crop, BLIP tokenizer, text encoder
    cross-attending to all image tokens, [CLS] output -> MLP -> (r - mean) / std."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35,
                       return_tensors="pt")
    assert (tokens.input_ids[:, 0] == tokenizer.cls_token_id).all()  # [CLS] first, as published
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    with torch.no_grad():
        image_tokens = vision(pixel_values=(images - mean) / std).last_hidden_state
        out = text(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                   encoder_hidden_states=image_tokens,
                   encoder_attention_mask=torch.ones(image_tokens.shape[:2], dtype=torch.long),
                   is_decoder=False).last_hidden_state
        raw = head(out[:, 0, :]).squeeze(-1)
    return (raw - 0.16717362830052426) / 1.0333394966054072


def test_scores_equal_the_original_modules(tiny_ir):
    vision, text, head, checkpoint_dir, tokenizer_dir = tiny_ir
    torch.manual_seed(1)
    images = (torch.rand(len(PROMPTS), 3, IMAGE_SIZE, IMAGE_SIZE) * 255).round() / 255
    reward = get_reward("imagereward", model=checkpoint_dir, tokenizer=tokenizer_dir,
                        vision_heads=VISION_HEADS, batch_size=2)
    scores = reward(images, PROMPTS)
    expected = _reference(vision, text, head, tokenizer_dir, images, PROMPTS)
    assert scores.dtype == torch.float32 and scores.shape == (len(PROMPTS),)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert reward.vision.config.layer_norm_eps == 1e-6  # BLIP's ViT; med's BERT: 1e-12
    assert reward.text.config.layer_norm_eps == 1e-12
    assert scores.std() > 0.1  # the random model separates the images: a meaningful comparison
    # The prompt matters (cross-attention and text path), and so does the image.
    other_prompt = reward(images[:1], ["two green triangles"])
    assert (other_prompt - scores[:1]).abs().item() > 1e-3
    # Batch-invariant and deterministic; the checkpoint file itself is accepted too.
    one = get_reward("imagereward", model=checkpoint_dir / CHECKPOINT_FILE,
                     tokenizer=tokenizer_dir, vision_heads=VISION_HEADS, batch_size=1)
    torch.testing.assert_close(one(images, PROMPTS), scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reward(images, PROMPTS), scores, rtol=0, atol=0)


def test_images_are_resized_and_cropped_as_published(tiny_ir):
    """A 48x40 image: shortest side to 32 with PIL's 8-bit bicubic, centre crop 32 at
    torchvision's offset round((38 - 32) / 2) = 3."""
    vision, text, head, checkpoint_dir, tokenizer_dir = tiny_ir
    torch.manual_seed(2)
    images = (torch.rand(2, 3, 48, 40) * 255).round() / 255
    reward = get_reward("imagereward", model=checkpoint_dir, tokenizer=tokenizer_dir,
                        vision_heads=VISION_HEADS)
    resized = torch.stack([  # int(32 * 48 / 40) = 38
        torch.from_numpy(np.array(Image.fromarray(
            (im.permute(1, 2, 0) * 255).round().byte().numpy()).resize((32, 38),
                                                                       Image.BICUBIC)))
        .permute(2, 0, 1).float() / 255 for im in images])
    cropped = resized[:, :, 3:35, :]
    expected = _reference(vision, text, head, tokenizer_dir, cropped, PROMPTS[:2])
    torch.testing.assert_close(reward(images, PROMPTS[:2]), expected, rtol=1e-5, atol=1e-5)


def test_preprocessing_constants_are_the_published_ones():
    preprocess = imagereward_preprocess()
    assert preprocess.shortest_edge == 224 and preprocess.crop == (224, 224)
    assert preprocess.mode == "bicubic"
    assert preprocess.mean == (0.48145466, 0.4578275, 0.40821073)
    assert preprocess.std == (0.26862954, 0.26130258, 0.27577711)
    # The authors' score normalisation and prompt length (ImageReward.py).
    assert (REWARD_MEAN, REWARD_STD) == (0.16717362830052426, 1.0333394966054072)
    assert MAX_LENGTH == 35


def _one_line_error(match, **kwargs):
    with pytest.raises(RewardLoadError, match=match) as err:
        get_reward("imagereward", vision_heads=VISION_HEADS, **kwargs)
    assert "\n" not in str(err.value)


def test_missing_files_are_one_line_errors(tiny_ir, tmp_path):
    _, _, _, checkpoint_dir, tokenizer_dir = tiny_ir
    _one_line_error(f"has no {CHECKPOINT_FILE}", model=tmp_path, tokenizer=tokenizer_dir)
    only_weights = tmp_path / "only-weights"
    only_weights.mkdir()
    (only_weights / CHECKPOINT_FILE).write_bytes((checkpoint_dir / CHECKPOINT_FILE).read_bytes())
    _one_line_error(f"has no {MED_CONFIG_FILE}", model=only_weights, tokenizer=tokenizer_dir)
    _one_line_error(f"{CHECKPOINT_FILE} of 'THUDM/ImageReward' is not in the Hugging Face cache",
                    tokenizer=tokenizer_dir)  # the default: the hub repo, not cached here
    _one_line_error("'google-bert/bert-base-uncased' is not a local directory",
                    model=checkpoint_dir)  # the default tokenizer, not cached here
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / CHECKPOINT_FILE).write_bytes(b"not a checkpoint")
    (garbage / MED_CONFIG_FILE).write_text("{}")
    _one_line_error("cannot read", model=garbage, tokenizer=tokenizer_dir)


def test_tokenizer_of_another_vocabulary_is_refused(tiny_ir, tmp_path):
    _, _, _, checkpoint_dir, _ = tiny_ir
    other, _ = save_bert_tokenizer(tmp_path / "other", words=WORDS[:-3])
    _one_line_error(r"has \d+ tokens with \[DEC\] and \[ENC\] but the model's text embedding",
                    model=checkpoint_dir, tokenizer=other)


def test_foreign_keys_and_mismatched_configs_are_refused(tiny_ir, tmp_path):
    vision, text, head, checkpoint_dir, tokenizer_dir = tiny_ir
    state = torch.load(checkpoint_dir / CHECKPOINT_FILE, weights_only=True)
    state["blip.itm_head.weight"] = torch.zeros(2, TEXT_WIDTH)  # BLIP's ITM head: not ImageReward
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save(state, bad / CHECKPOINT_FILE)
    (bad / MED_CONFIG_FILE).write_text((checkpoint_dir / MED_CONFIG_FILE).read_text())
    _one_line_error("itm_head", model=bad, tokenizer=tokenizer_dir)
    config = json.loads((checkpoint_dir / MED_CONFIG_FILE).read_text())
    config["num_hidden_layers"] = 12
    (bad / MED_CONFIG_FILE).write_text(json.dumps(config))
    torch.save(authors_state_dict(vision, text, head), bad / CHECKPOINT_FILE)
    _one_line_error("num_hidden_layers", model=bad, tokenizer=tokenizer_dir)
    with pytest.raises(RewardLoadError, match="not divisible by 5 heads"):
        get_reward("imagereward", model=checkpoint_dir, tokenizer=tokenizer_dir, vision_heads=5)
