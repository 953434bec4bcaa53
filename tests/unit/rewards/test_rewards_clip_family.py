"""`clip`, `pickscore` and `aesthetic` on tiny random CLIPModels saved like the real ones and loaded
by name through the real loader: scores against a recomputation by hand, determinism, batch
invariance, each checkpoint's own preprocessing, and the load errors."""

import json

import huggingface_hub.constants
import pytest
import torch
from reward_models_tiny import OPENAI_MEAN, OPENAI_STD, save_aesthetic_head, save_tiny_clip
from transformers import AutoTokenizer, CLIPModel

from chunk_grpo.cli.runner import run_cli
from chunk_grpo.rewards import RewardLoadError, get_reward
from chunk_grpo.rewards.pickscore import PICKSCORE_PROCESSOR

PROMPTS = ["a red circle", "a blue square", "a red circle", "two green triangles",
           "a small yellow circle on the left", "a blue square", "a red circle"]
# float32 matmuls of other batch shapes round differently (measured up to 2e-6 on these scores).
BATCH_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path, monkeypatch):
    """Hub ids resolve against an empty cache: nothing the machine happens to hold is used."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def _images(seed: int, n: int = 7, size: int = 32) -> torch.Tensor:
    """8-bit images as floats: what the rewards see after their 8-bit rounding."""
    torch.manual_seed(seed)
    return (torch.rand(n, 3, size, size) * 255).round() / 255


def _by_hand(directory, images, prompts, mean=OPENAI_MEAN, std=OPENAI_STD, processor=None):
    """Unit image and text embeddings and exp(logit_scale) of the saved model, computed with its
    own get_image_features / get_text_features. Images already have the model's size, so the
    preprocessing is the normalisation alone."""
    model = CLIPModel.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(processor or directory)
    pixels = (images - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
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
    return image, text, model.logit_scale.exp().item()


def test_clip_score_matches_hand_computation(clip_dir):
    reward = get_reward("clip", model=str(clip_dir))
    images = _images(0)
    scores = reward(images, PROMPTS)
    image, text, scale = _by_hand(clip_dir, images, PROMPTS)
    assert scale == pytest.approx(torch.tensor(3.0).exp().item())
    assert scores.dtype == torch.float32 and scores.device.type == "cpu"
    torch.testing.assert_close(scores, scale * (image * text).sum(-1), rtol=1e-5, atol=1e-5)
    # The prompt matters: the same image under another prompt scores differently.
    other = reward(images[:1], ["two green triangles"])
    assert not torch.allclose(other, scores[:1])


def test_clip_is_deterministic_and_batch_invariant(clip_dir):
    images = _images(1, size=64)  # resized to the model's 32x32 on the way
    one = get_reward("clip", model=str(clip_dir), batch_size=1)(images, PROMPTS)
    seven = get_reward("clip", model=str(clip_dir), batch_size=7)
    torch.testing.assert_close(seven(images, PROMPTS), seven(images, PROMPTS), rtol=0, atol=0)
    torch.testing.assert_close(one, seven(images, PROMPTS), **BATCH_TOL)
    three = get_reward("clip", model=str(clip_dir), batch_size=3)(images, PROMPTS)
    torch.testing.assert_close(one, three, **BATCH_TOL)


def test_a_64px_checkpoint_with_its_own_mean_std(tmp_path):
    """Like the project's shapes-clip: 64x64 inputs, other normalisation constants."""
    mean, std = (0.5, 0.45, 0.4), (0.25, 0.2, 0.3)
    directory = save_tiny_clip(tmp_path / "shapes-like", image_size=64, patch_size=16,
                               mean=mean, std=std)
    images = _images(2, n=3, size=64)
    scores = get_reward("clip", model=directory)(images, PROMPTS[:3])
    image, text, scale = _by_hand(directory, images, PROMPTS[:3], mean=mean, std=std)
    torch.testing.assert_close(scores, scale * (image * text).sum(-1), rtol=1e-5, atol=1e-5)


def test_tokenizer_from_vocab_and_merges_files(clip_dir, tmp_path):
    """The older CLIPTokenizer layout (vocab.json + merges.txt, no tokenizer.json) loads too."""
    directory = tmp_path / "slow-tokenizer"
    directory.mkdir()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json",
                 "tokenizer_config.json"):
        (directory / name).write_bytes((clip_dir / name).read_bytes())
    model = json.loads((clip_dir / "tokenizer.json").read_text())["model"]
    (directory / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    images = _images(3, n=3)
    expected = get_reward("clip", model=clip_dir)(images, PROMPTS[:3])
    torch.testing.assert_close(get_reward("clip", model=directory)(images, PROMPTS[:3]),
                               expected, rtol=1e-6, atol=1e-6)


def test_pickscore_takes_its_processor_from_another_directory(clip_dir, tmp_path):
    weights_only = tmp_path / "pickscore"
    CLIPModel.from_pretrained(clip_dir).save_pretrained(weights_only)  # no tokenizer, no config
    images = _images(4)
    scores = get_reward("pickscore", model=weights_only, processor=clip_dir)(images, PROMPTS)
    image, text, scale = _by_hand(weights_only, images, PROMPTS, processor=clip_dir)
    torch.testing.assert_close(scores, scale * (image * text).sum(-1), rtol=1e-5, atol=1e-5)
    # Its default processor is ViT-H-14's, by hub id: not in the (empty) cache -> named.
    with pytest.raises(RewardLoadError, match=PICKSCORE_PROCESSOR):
        get_reward("pickscore", model=weights_only)


def _head_by_hand(head_path, embeddings):
    """The published MLP as explicit matmuls: Linear layers at Sequential places 0, 2, 4, 6, 7."""
    state = torch.load(head_path)
    x = embeddings
    for index in (0, 2, 4, 6, 7):
        x = x @ state[f"layers.{index}.weight"].T + state[f"layers.{index}.bias"]
    return x.squeeze(-1)


def test_aesthetic_matches_hand_computation(tmp_path):
    directory = save_tiny_clip(tmp_path / "clip-l14-like", projection_dim=24)
    head = save_aesthetic_head(directory, input_size=24)
    images = _images(5)
    one = get_reward("aesthetic", model=directory, batch_size=1)(images, PROMPTS)
    seven = get_reward("aesthetic", model=directory, batch_size=7)(images, PROMPTS)
    image, _, _ = _by_hand(directory, images, PROMPTS)
    torch.testing.assert_close(seven, _head_by_hand(head, image), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, seven, **BATCH_TOL)
    # The head may live anywhere.
    moved = tmp_path / "elsewhere.pth"
    moved.write_bytes(head.read_bytes())
    head.unlink()
    with pytest.raises(RewardLoadError, match="sac\\+logos\\+ava1-l14-linearMSE.pth"):
        get_reward("aesthetic", model=directory)
    torch.testing.assert_close(get_reward("aesthetic", model=directory, head=moved)(
        images, PROMPTS), seven, rtol=0, atol=0)


def test_aesthetic_head_of_the_wrong_width_is_refused(tmp_path):
    directory = save_tiny_clip(tmp_path / "clip", projection_dim=16)
    save_aesthetic_head(directory, input_size=768)  # ViT-L/14's head on another CLIP
    with pytest.raises(RewardLoadError, match="16-d CLIP embeddings"):
        get_reward("aesthetic", model=directory)


def test_missing_directory_and_uncached_hub_id_name_the_model(tmp_path):
    missing = tmp_path / "no-such-clip"
    with pytest.raises(RewardLoadError, match="no-such-clip"):
        get_reward("clip", model=str(missing))
    with pytest.raises(RewardLoadError, match=r"'someone/some-clip'.*hf download someone/some-c"):
        get_reward("clip", model="someone/some-clip")
    with pytest.raises(RewardLoadError, match="openai/clip-vit-large-patch14"):
        get_reward("clip")  # the default checkpoint is not in the empty cache


def test_deleted_tokenizer_is_an_error_not_a_stub(clip_dir, tmp_path):
    """Without tokenizer.json, transformers rebuilds a 2-token tokenizer without complaint."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in clip_dir.iterdir():
        if f.name != "tokenizer.json":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(RewardLoadError, match=r"broken.*has 2 tokens.*593"):
        get_reward("clip", model=broken)


def test_missing_weights_and_foreign_processor_are_errors(clip_dir, tmp_path):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for f in clip_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            (no_weights / f.name).write_bytes(f.read_bytes())
    with pytest.raises(RewardLoadError, match="no-weights"):
        get_reward("clip", model=no_weights)
    big = save_tiny_clip(tmp_path / "64px", image_size=64, patch_size=16)
    with pytest.raises(RewardLoadError, match=r"crops to \(64, 64\).*takes 32x32"):
        get_reward("clip", model=clip_dir, processor=big)


def test_cli_reports_a_load_error_in_one_line(tmp_path, capsys):
    absent = tmp_path / "absent"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: get_reward("clip", model=str(absent)), "x")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m x: error: reward 'clip'")
    assert str(absent) in lines[0]


def test_hub_id_resolves_from_the_local_cache(clip_dir, tmp_path):
    """A hub id is looked up in the Hugging Face cache layout, offline."""
    cache = tmp_path / "hf-cache" / "models--someone--tiny-clip"
    revision = "0" * 40
    snapshot = cache / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(revision)
    for f in clip_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    images = _images(6, n=3)
    torch.testing.assert_close(get_reward("clip", model="someone/tiny-clip")(images, PROMPTS[:3]),
                               get_reward("clip", model=clip_dir)(images, PROMPTS[:3]),
                               rtol=0, atol=0)
