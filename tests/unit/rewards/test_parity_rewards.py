"""Every CLIP-family reward, ImageReward and HPSv3 against its authors' own code, on golden
fixtures.

tests/fixtures/parity/ is written by tools/make_parity_fixtures.py in side environments with the
authors' packages (hpsv2 1.2.0, OpenAI's clip, image-reward 1.5, hpsv3 1.0.0, transformers
4.45.2): tiny random models in the authors' classes and layouts, 8-bit images (square, wide,
tall and 224x224), prompts that need cleaning or truncation, and the scores and token ids the
authors' code gives. Here the same files go through the project's loaders. The CLIP tokenizers
use the real CLIP BPE vocabulary (bpe_simple_vocab_16e6.txt.gz, as OpenAI's clip and open_clip
ship it); ImageReward's BERT tokenizer uses a synthetic WordPiece vocabulary in place of
bert-base-uncased's, HPSv3's a byte-level BPE in place of Qwen2's (neither can be fetched).
"""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import CLIPTokenizer

from chunk_grpo.rewards import get_reward
from chunk_grpo.rewards.text_clean import clip_clean

FIXTURES = Path(__file__).parents[2] / "fixtures" / "parity"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())
KINDS = GOLDEN["images"]  # square, wide, tall, 224
PROMPTS = GOLDEN["prompts"]


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP's byte -> printable character table, in its order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> Path:
    """A CLIP tokenizer (vocab.json + merges.txt of the real BPE) and the fixture's
    preprocessor_config.json: what laion/CLIP-ViT-H-14 and openai/clip-* directories hold."""
    root = tmp_path_factory.mktemp("processor")
    merges = gzip.open(FIXTURES / "bpe_simple_vocab_16e6.txt.gz").read().decode("utf-8")
    merges = merges.split("\n")[1:49152 - 256 - 2 + 1]
    alphabet = _bytes_to_unicode()
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    (root / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    CLIPTokenizer(str(root / "vocab.json"), str(root / "merges.txt"),
                  model_max_length=77).save_pretrained(root)
    shutil.copy(FIXTURES / "clip" / "preprocessor_config.json", root)
    return root


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory, processor_dir) -> Path:
    """The fixture CLIPModel with its tokenizer beside it (a model directory as downloaded)."""
    root = tmp_path_factory.mktemp("clip") / "clip"
    shutil.copytree(FIXTURES / "clip", root)
    for f in processor_dir.iterdir():
        shutil.copy(f, root)
    return root


def _images() -> dict[str, torch.Tensor]:
    return {k: v.float() / 255 for k, v in torch.load(FIXTURES / "images.pt").items()}


def _score_grid(reward) -> torch.Tensor:
    """[image kind, prompt] scores, each image scored against every prompt."""
    rows = []
    for image in _images().values():
        rows.append(reward(image[None].expand(len(PROMPTS), -1, -1, -1), PROMPTS))
    return torch.stack(rows)


def _check(name: str, got: torch.Tensor, atol: float) -> None:
    want = torch.tensor(GOLDEN[name]["scores"])
    if want.dim() == 1:
        want = want[:, None].expand_as(got)
    for i, kind in enumerate(KINDS):  # one kind at a time, so a failure names the image kind
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=atol,
                                   msg=lambda m, kind=kind: f"{name}, {kind} image: {m}")


def _ids_until_end(ids: list[int], end: int) -> list[int]:
    return ids[:ids.index(end) + 1]


def test_hpsv2_matches_hpsv2_score(processor_dir):
    """hpsv2.score: ResizeMaxSize with black padding, open_clip's cleaning, fp16 checkpoint."""
    reward = get_reward("hpsv2", model=FIXTURES / "hpsv2", processor=processor_dir, heads=(2, 2))
    _check("hpsv2", _score_grid(reward), atol=2e-6)


def test_pickscore_matches_its_processor_and_model(clip_dir, processor_dir):
    reward = get_reward("pickscore", model=clip_dir, processor=processor_dir)
    _check("pickscore", _score_grid(reward), atol=5e-5)  # scores ~ e^3 * cos


def test_clip_matches_openai_clip_inputs(clip_dir):
    reward = get_reward("clip", model=clip_dir)
    _check("clip", _score_grid(reward), atol=5e-5)


def test_aesthetic_matches_the_laion_head_on_clip_processor_pixels(clip_dir):
    reward = get_reward("aesthetic", model=clip_dir)
    _check("aesthetic", _score_grid(reward), atol=2e-6)


@pytest.mark.parametrize("reward,clean", [("hpsv2", True), ("clip", True),
                                          ("pickscore", False)])
def test_token_ids_are_the_authors(processor_dir, reward, clean):
    """open_clip's and OpenAI clip's tokenizers (ftfy, HTML unescaping: `Tom &amp; Jerry`,
    `Van Gogh’s`) are clip_clean + the transformers tokenizer; PickScore's CLIPProcessor is
    the transformers tokenizer alone. A long prompt keeps 75 tokens between start and end."""
    tokenizer = CLIPTokenizer.from_pretrained(processor_dir)
    end = tokenizer.eos_token_id
    texts = [clip_clean(p) for p in PROMPTS] if clean else PROMPTS
    ours = tokenizer(texts, truncation=True, max_length=77)["input_ids"]
    for prompt, got, want in zip(PROMPTS, ours, GOLDEN[reward]["input_ids"], strict=True):
        assert got == _ids_until_end(want, end), prompt
    assert len(ours[-1]) == 77
    if clean:  # the cleaning changes these prompts' tokens: without it they would differ
        raw = tokenizer(PROMPTS[1:3], truncation=True, max_length=77)["input_ids"]
        assert all(r != _ids_until_end(w, end)
                   for r, w in zip(raw, GOLDEN[reward]["input_ids"][1:3], strict=True))


def test_imagereward_matches_imagereward_score():
    """ImageReward.load + ImageReward.score (image-reward 1.5) on a tiny BLIP saved as
    ImageReward.pt + med_config.json. bert-base-uncased's vocabulary cannot be fetched: a
    synthetic WordPiece vocab.txt (BERT's special tokens, characters, ##-pieces and some words)
    stands in, run through the authors' BertTokenizer and this project's tokenizer alike."""
    reward = get_reward("imagereward", model=FIXTURES / "imagereward",
                        tokenizer=FIXTURES / "imagereward" / "tokenizer", vision_heads=2)
    _check("imagereward", _score_grid(reward), atol=2e-6)


def test_imagereward_token_ids_are_the_authors():
    """BERT's cleaning (lower case, accents stripped, punctuation split, `&amp;` kept as text)
    and truncation at 35 tokens, padded to 35, as the authors' tokenizer call gives them."""
    reward = get_reward("imagereward", model=FIXTURES / "imagereward",
                        tokenizer=FIXTURES / "imagereward" / "tokenizer", vision_heads=2)
    ids = reward.tokenizer(PROMPTS, padding="max_length", truncation=True,
                           max_length=reward.max_length)["input_ids"]
    assert ids == GOLDEN["imagereward"]["input_ids"]
    # Characters outside the vocabulary (the "\ufb01" ligature, curly double quotes): [UNK].
    assert reward.tokenizer.unk_token_id in ids[2]


HPSV3_GOLDEN = json.loads((FIXTURES / "hpsv3" / "golden.json").read_text())


def test_hpsv3_matches_hpsv3_reward_inferencer():
    """HPSv3RewardInferencer.reward (hpsv3 1.0.0, transformers 4.45.2) on a tiny Qwen2-VL
    reward model (create_model_and_processor, Qwen2VLRewardModelBT) saved as
    HPSv3.safetensors; the authors' HPSv3_7B.yaml with bf16 off (fp32 on both sides). Qwen2's
    vocabulary cannot be fetched: a byte-level BPE trained on the instruction and prompts,
    with Qwen2-VL's special tokens, stands in."""
    reward = get_reward("hpsv3", model=FIXTURES / "hpsv3", batch_size=len(PROMPTS))
    want = torch.tensor(HPSV3_GOLDEN["scores"])
    got = _score_grid(reward)
    for i, kind in enumerate(KINDS):
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=2e-6,
                                   msg=lambda m, kind=kind: f"hpsv3, {kind} image: {m}")
    square = _images()["square"][None].expand(len(PROMPTS), -1, -1, -1)
    inputs = reward.preprocess(square, PROMPTS)
    assert inputs["input_ids"].tolist() == HPSV3_GOLDEN["input_ids"]
    assert inputs["image_grid_thw"].tolist() == HPSV3_GOLDEN["image_grid_thw"]
