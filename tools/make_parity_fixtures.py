"""Golden fixtures from the reward and GRPO authors' own code, for tests/test_parity_*.py.

The authors' packages cannot be installed beside this project's torch and transformers, so they
live in a side virtual environment; this script builds it and, run again inside it, makes tiny
random models in the authors' own classes, saves them in the authors' checkpoint layouts, scores
fixed 8-bit images and prompts with the authors' scoring code, and writes everything into
tests/fixtures/parity/. The regular tests load those files through the project's loaders and
compare: CI needs no side environment.

    python tools/make_parity_fixtures.py venv --venv /work/venvs/parity-authors \\
        --hpsv3-venv /work/venvs/parity-hpsv3
    python tools/make_parity_fixtures.py generate --venv /work/venvs/parity-authors \\
        --hpsv3-venv /work/venvs/parity-hpsv3 \\
        --flow-grpo FLOW_GRPO/flow_grpo/diffusers_patch/sd3_sde_with_logprob.py \\
        --dance-grpo DANCEGRPO/fastvideo/train_grpo_flux.py \\
        --gcpo GCPO/fastvideo/train_grpo_flux_pickscore.py

The three files are read from checkouts of github.com/yifan123/flow_grpo,
github.com/XueZeyue/DanceGRPO and github.com/xingzhejun/GCPO (none is on PyPI); only the step
function is taken from each (by name, with `ast`) and run. Every random draw is seeded: running
`generate` again writes byte-identical files.

Side environment (`venv`): torch 2.13.0 (CPU), torchvision 0.28.0, transformers 4.45.2 (hpsv3's
pin), hpsv2 1.2.0, openai-clip 1.0.1 (OpenAI's `clip` package), image-reward 1.5 (with timm
0.6.13 and fairscale), diffusers (the scheduler Flow-GRPO's step takes). Two repairs, both
outside the authors' code: hpsv2 1.2.0's wheel lacks its BPE file
(bpe_simple_vocab_16e6.txt.gz), which is copied in from `clip` (the same file); and PyPI's
torchvision is built against CUDA torch, so its C ops cannot load beside the CPU torch: the two
operator names its import registers fakes for are declared first (no torchvision op is used).
ImageReward: its package __init__ (the ReFL training script) is skipped, its model modules are
imported as they are; bert-base-uncased's vocabulary cannot be fetched, so a synthetic WordPiece
vocab.txt stands in for it (BERT_WORDS), served to the authors' tokenizer from an offline hub cache.

HPSv3 needs its own environment (`--hpsv3-venv`; hpsv3 1.0.0 pins transformers 4.45.2 and its
training imports need trl 0.11 and peft): torch 2.13.0 (CPU), its pins, hpsv3 without deepspeed,
qwen-vl-utils or opencv (training and data-loading requirements the inferencer never imports; no
stub stands in). Qwen2's vocabulary cannot be fetched: a byte-level BPE trained on the
instruction and prompts, with Qwen2-VL's special tokens and Qwen2's NFC normaliser, stands in.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "parity"
SIDE_PACKAGES = [
    "torch==2.13.0", "torchvision==0.28.0", "transformers==4.45.2", "diffusers==0.35.2",
    "ftfy==6.3.1", "regex", "einops", "timm==0.6.13", "huggingface-hub<1", "pillow",
    "numpy<2.3", "safetensors", "sentencepiece", "setuptools<81", "clint", "openai-clip==1.0.1",
    "fairscale==0.4.13",
]
# Their other requirements are unused: hpsv2's pytest pins and webdataset; image-reward's
# accelerate and datasets (its ReFL training script, which is not imported here).
NO_DEPS = ["hpsv2==1.2.0", "image-reward==1.5"]

# The inputs: 8-bit images of each kind the rewards see, and prompts that need cleaning.
IMAGE_SIZES = {"square": (160, 160), "wide": (120, 200), "tall": (200, 136), "224": (224, 224)}
PROMPTS = [
    "a photo of a cat",
    "Tom &amp; Jerry on a sofa",
    "Van Gogh\u2019s \u201cStarry Night\u201d over a \ufb01eld",
    "  lots   of\twhitespace\nhere ",
    "caf\u0065\u0301 cr\u00e8me br\u00fbl\u00e9e, 4K",
    " ".join(["a very long prompt about a red circle and a blue square"] * 12),
]
TEXT_WIDTH, VISION_WIDTH, EMBED = 8, 32, 16  # tiny towers; the text embedding is 49408 x 8
# ImageReward's BLIP, tiny: ViT of width 32 (patch 16 at 224, as ViT-L/16), med BERT of width 32.
BLIP_VISION_WIDTH, BLIP_VISION_HEADS, BLIP_TEXT_WIDTH = 32, 2, 32
# bert-base-uncased's vocab.txt cannot be fetched, so a synthetic WordPiece vocabulary stands in:
# its special tokens, characters and ##-pieces, and a few whole words of the prompts (others split
# into pieces or become [UNK], e.g. the "\ufb01" ligature), uncased and accent-stripped as BERT's.
HPSV3_PACKAGES = [  # hpsv3 1.0.0's pins (transformers 4.45.2); deepspeed is for training only
    "torch==2.13.0", "torchvision==0.28.0", "transformers==4.45.2", "trl==0.11.4", "peft==0.13.2",
    "accelerate", "datasets", "omegaconf", "fire", "pandas", "matplotlib", "tensorboard", "rich",
    "safetensors", "numpy<2.3", "pillow", "pyyaml", "einops", "requests",
]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                 "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                 "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                 "<|image_pad|>", "<|video_pad|>"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_WORDS = ["a", "photo", "of", "cat", "tom", "jerry", "on", "sofa", "van", "go", "##gh",
              "starry", "night", "over", "field", "lots", "white", "##space", "here", "cafe",
              "creme", "br", "##ule", "##e", "4", "##k", "very", "long", "prompt", "about",
              "red", "circle", "and", "blue", "square"]


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def make_venv(venv: Path) -> None:
    """The side environment with the authors' packages (see the module docstring)."""
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run(pip + SIDE_PACKAGES)
    _run(pip + ["--no-deps"] + NO_DEPS)
    code = ("import clip, os, shutil, importlib.util as u; "
            "src = os.path.join(os.path.dirname(clip.__file__), 'bpe_simple_vocab_16e6.txt.gz'); "
            "dst = os.path.join(os.path.dirname(u.find_spec('hpsv2').origin), 'src', "
            "'open_clip'); shutil.copy(src, dst)")
    _run([str(venv / "bin" / "python"), "-c", code])


def make_hpsv3_venv(venv: Path) -> None:
    """hpsv3's side environment: its pins, hpsv3 itself without deepspeed/qwen-vl-utils/opencv
    (training and data-loading requirements its inferencer does not import)."""
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run(pip + HPSV3_PACKAGES)
    _run(pip + ["--no-deps", "hpsv3==1.0.0"])


def load_constant(path: Path, name: str):
    """The literal value of the top-level assignment `name = ...` in the Python file `path`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets
                                             if isinstance(t, ast.Name)] == [name]:
            return ast.literal_eval(node.value)
    raise SystemExit(f"{path} assigns no top-level {name!r}")


def load_function(path: Path, name: str, namespace: dict):
    """The top-level function `name` of the Python file `path`, executed alone in `namespace`
    (the rest of the file, with its training-time imports, is not run)."""
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
            return namespace[name]
    raise SystemExit(f"{path} defines no top-level function {name!r}")


# ---------------------------------------------------------------- inside the side environment


def _side_imports():
    import torch

    for op in ("nms", "qnms"):  # see the module docstring: torchvision's C ops cannot load
        torch.library.define(f"torchvision::{op}",
                             "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision  # noqa: F401


def _images():
    import torch

    out = {}
    for i, (name, (h, w)) in enumerate(IMAGE_SIZES.items()):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.nn.functional.avg_pool2d(torch.rand(1, 3, h, w, generator=g), 5, 1, 2)
        ramp = torch.linspace(0, 1, w).view(1, 1, 1, w)  # some structure across the image
        out[name] = ((0.7 * x + 0.3 * ramp).clamp(0, 1) * 255).round().to(torch.uint8)[0]
    return out


def _pil(image):
    from PIL import Image

    return Image.fromarray(image.permute(1, 2, 0).numpy())


def _vocab_files(directory: Path, bpe: Path) -> None:
    """vocab.json + merges.txt of the CLIP BPE file, laid out as OpenAI's SimpleTokenizer
    builds its table (the files of every transformers CLIP tokenizer)."""
    import gzip

    from clip.simple_tokenizer import bytes_to_unicode

    merges = gzip.open(bpe).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def _hpsv2(out: Path, images, golden: dict) -> None:
    """A tiny open_clip CLIP in hpsv2's own copy of open_clip, scored by `hpsv2.score`."""
    import hpsv2.img_score as img_score
    import torch
    from hpsv2.src.open_clip import create_model_and_transforms, factory, get_tokenizer

    factory._MODEL_CONFIGS["parity-tiny"] = {
        "embed_dim": EMBED,
        "vision_cfg": {"image_size": 224, "layers": 2, "width": VISION_WIDTH, "head_width": 16,
                       "patch_size": 32},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": TEXT_WIDTH,
                     "heads": 2, "layers": 2},
    }
    torch.manual_seed(1)
    # initialize_model()'s arguments, with the tiny model in place of the downloaded ViT-H-14.
    model, _, preprocess_val = create_model_and_transforms(
        "parity-tiny", None, precision="fp32", device="cpu", jit=False, force_quick_gelu=False,
        force_custom_text=False, force_patch_dropout=False, force_image_size=None,
        pretrained_image=False, image_mean=None, image_std=None, light_augmentation=True,
        aug_cfg={}, output_dict=True, with_score_predictor=False, with_region_predictor=False)
    with torch.no_grad():
        for p in model.parameters():  # away from the init's zeros and ones
            p.add_(0.02 * torch.randn_like(p))
    (out / "hpsv2").mkdir(parents=True, exist_ok=True)
    checkpoint = out / "hpsv2" / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {k: v.half() for k, v in model.state_dict().items()}}, checkpoint)
    img_score.device = "cpu"
    img_score.model_dict.update(model=model, preprocess_val=preprocess_val)
    scores = [[float(img_score.score(_pil(images[name]), prompt, cp=str(checkpoint))[0])
               for prompt in PROMPTS] for name in IMAGE_SIZES]
    tokens = get_tokenizer("ViT-H-14")(PROMPTS)
    golden["hpsv2"] = {"scores": scores, "input_ids": tokens.tolist()}


def _hf_clip(out: Path, bpe: Path, images, golden: dict) -> None:
    """A tiny transformers CLIPModel (the class PickScore, Flow-GRPO's aesthetic scorer and the
    CLIP score run on): PickScore's processor/scoring, OpenAI clip's tokenizer and transform,
    the LAION aesthetic head."""
    import clip
    import torch
    from torch import nn
    from transformers import (
        AutoModel,
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTokenizerFast,
    )

    directory, processor_dir = out / "clip", Path(tempfile.mkdtemp()) / "processor"
    torch.manual_seed(2)
    config = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=TEXT_WIDTH, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                         bos_token_id=49406, eos_token_id=49407, pad_token_id=49407),
        vision_config=dict(hidden_size=VISION_WIDTH, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=224, patch_size=32),
        projection_dim=EMBED)
    model = CLIPModel(config).eval()
    with torch.no_grad():
        model.logit_scale.fill_(3.0)
    model.half().save_pretrained(directory)
    model = AutoModel.from_pretrained(directory).eval()  # fp32, as the authors load it
    # laion/CLIP-ViT-H-14's processor: its preprocessor_config.json, tokenizer from the BPE.
    CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                       image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711]).save_pretrained(directory)
    _vocab_files(processor_dir, bpe)
    CLIPTokenizerFast(processor_dir / "vocab.json", processor_dir / "merges.txt",
                      model_max_length=77).save_pretrained(processor_dir)
    shutil.copy(directory / "preprocessor_config.json", processor_dir)
    # AutoProcessor.from_pretrained(laion's repo) is this CLIPProcessor (the repo's config.json
    # names the class; the processor files here have none).
    processor = CLIPProcessor.from_pretrained(processor_dir)
    pil = [_pil(images[name]) for name in IMAGE_SIZES]

    def unit(x):
        return x / x.norm(p=2, dim=-1, keepdim=True)

    with torch.no_grad():
        # PickScore's inference code (its README; Flow-GRPO's scorer before its / 26).
        image_inputs = processor(images=pil, padding=True, truncation=True, max_length=77,
                                 return_tensors="pt")
        text_inputs = processor(text=PROMPTS, padding=True, truncation=True, max_length=77,
                                return_tensors="pt")
        image_embs = unit(model.get_image_features(**image_inputs))
        text_embs = unit(model.get_text_features(**text_inputs))
        pick = model.logit_scale.exp() * image_embs @ text_embs.T
        hf_ids = processor.tokenizer(PROMPTS, padding="max_length", truncation=True,
                                     max_length=77)["input_ids"]
        # CLIP score with OpenAI clip's tokenizer and transform on the same CLIPModel.
        transform = clip.clip._transform(224)
        pixels = torch.stack([transform(p) for p in pil])
        ids = clip.tokenize(PROMPTS, truncate=True)
        clip_image = unit(model.get_image_features(pixel_values=pixels))
        clip_text = unit(model.get_text_features(input_ids=ids))
        clip_scores = model.logit_scale.exp() * clip_image @ clip_text.T
        # The LAION improved aesthetic predictor: its MLP(input_size) on the unit embedding.
        torch.manual_seed(3)
        head = nn.Module()
        head.layers = nn.Sequential(
            nn.Linear(EMBED, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
        torch.save({k: v.half() for k, v in head.state_dict().items()},
                   directory / "sac+logos+ava1-l14-linearMSE.pth")
        head.load_state_dict(torch.load(directory / "sac+logos+ava1-l14-linearMSE.pth"))
        head.eval()
        aesthetic = head.layers(image_embs).squeeze(1)
    shutil.rmtree(processor_dir.parent)
    golden["pickscore"] = {"scores": pick.tolist(), "input_ids": hf_ids}
    golden["clip"] = {"scores": clip_scores.tolist(), "input_ids": ids.tolist()}
    golden["aesthetic"] = {"scores": aesthetic.tolist()}


def _bert_vocab(cache: Path) -> None:
    """The synthetic vocab.txt (see BERT_WORDS) as the hub cache's bert-base-uncased snapshot, so
    the authors' `init_tokenizer` (BertTokenizer.from_pretrained('bert-base-uncased')) runs as
    written, offline."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789&;,.'\u2019\"")
    tokens = dict.fromkeys(BERT_SPECIALS + BERT_WORDS + letters + ["##" + c for c in letters])
    repo = cache / "models--bert-base-uncased"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (snapshot / "vocab.txt").write_text("\n".join(tokens) + "\n")


def _imagereward_modules():
    """ImageReward's model and loader modules, without the package's __init__: that imports its
    ReFL training script (accelerate, datasets, diffusers' training utilities), which scoring does
    not use. The package object is created empty and its submodules imported as they are."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("ImageReward")
    package = types.ModuleType("ImageReward")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["ImageReward"] = package
    import ImageReward.ImageReward as ir_module
    import ImageReward.models.BLIP.blip_pretrain as blip_pretrain
    import ImageReward.utils as ir_utils
    from ImageReward.models.BLIP.vit import VisionTransformer

    return ir_module, blip_pretrain, ir_utils, VisionTransformer


def _imagereward(out: Path, images, golden: dict) -> None:
    """A tiny ImageReward in the authors' classes (their BLIP ViT, med BERT and MLP), saved as
    ImageReward.pt + med_config.json, loaded by `ImageReward.load` and scored by
    `ImageReward.score`. The constructor hard-codes ViT-L and MLP(768): its two factories are
    swapped for the same classes at tiny sizes (everything else runs as published)."""
    import torch
    from transformers import BertTokenizer

    ir_module, blip_pretrain, ir_utils, VisionTransformer = _imagereward_modules()

    def tiny_vit(vit, image_size, use_grad_checkpointing=False, ckpt_layer=0, drop_path_rate=0):
        return VisionTransformer(img_size=image_size, patch_size=16, embed_dim=BLIP_VISION_WIDTH,
                                 depth=2, num_heads=BLIP_VISION_HEADS, mlp_ratio=2.0,
                                 drop_path_rate=0.1), BLIP_VISION_WIDTH

    mlp, create_vit = ir_module.MLP, blip_pretrain.create_vit
    blip_pretrain.create_vit = tiny_vit
    ir_module.MLP = lambda input_size: mlp(BLIP_TEXT_WIDTH)
    directory = out / "imagereward"
    directory.mkdir(parents=True, exist_ok=True)
    vocab = len(BertTokenizer.from_pretrained("bert-base-uncased"))
    # THUDM/ImageReward's med_config.json, at tiny sizes (vocab: BERT's + [DEC] and [ENC]).
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1,
           "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": BLIP_TEXT_WIDTH,
           "initializer_range": 0.02, "intermediate_size": 64, "layer_norm_eps": 1e-12,
           "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 4,
           "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2,
           "vocab_size": vocab + 2, "encoder_width": BLIP_VISION_WIDTH,
           "add_cross_attention": True}
    med_path = directory / "med_config.json"
    med_path.write_text(json.dumps(med, indent=2) + "\n")
    torch.manual_seed(5)
    model = ir_module.ImageReward(med_config=str(med_path), device="cpu")
    with torch.no_grad():  # weights large enough that the image and every token matter
        for p in model.blip.parameters():
            p.normal_(0.0, 0.3)
        for p in model.mlp.parameters():  # unit scale through the five layers
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1)
    checkpoint = directory / "ImageReward.pt"
    torch.save(model.state_dict(), checkpoint)
    model = ir_utils.load(str(checkpoint), device="cpu", med_config=str(med_path))
    with torch.no_grad():
        scores = [[model.score(prompt, _pil(images[name])) for prompt in PROMPTS]
                  for name in IMAGE_SIZES]
    ids = model.blip.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35)
    # The tokenizer as the hub's bert-base-uncased directory holds it (before BLIP's additions).
    BertTokenizer.from_pretrained("bert-base-uncased").save_pretrained(directory / "tokenizer")
    ir_module.MLP, blip_pretrain.create_vit = mlp, create_vit
    golden["imagereward"] = {"scores": scores, "input_ids": ids["input_ids"]}


def _hpsv3_base(base: Path, instruction: str) -> None:
    """A tiny Qwen2-VL directory as Qwen/Qwen2-VL-7B-Instruct is laid out (flat 4.45 config,
    processor, chat template, weights): the authors' `model_name_or_path`. Its tokenizer is a
    byte-level BPE trained here on the instruction and prompts with Qwen2-VL's special tokens
    (Qwen2's 151k-token vocabulary cannot be fetched)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import (
        Qwen2TokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
    )

    # Qwen2-VL-7B-Instruct's published chat template (the project's tiny HPSv3 holds a copy).
    template = load_constant(ROOT / "tests" / "hpsv3_tiny.py", "QWEN2_VL_TEMPLATE")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=QWEN_SPECIALS,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([instruction] + PROMPTS, trainer)
    tokenizer = Qwen2TokenizerFast(tokenizer_object=bpe,
                                   additional_special_tokens=QWEN_SPECIALS[1:],
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    config = Qwen2VLConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        vocab_size=len(tokenizer) + 64, tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=ids["<|vision_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_config={"depth": 1, "embed_dim": 16, "mlp_ratio": 2, "num_heads": 2,
                       "in_chans": 3, "hidden_size": 32, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2})
    torch.manual_seed(6)
    Qwen2VLForConditionalGeneration(config).save_pretrained(base)
    processor = Qwen2VLProcessor(Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056),
                                 tokenizer, chat_template=template)
    processor.save_pretrained(base)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(base)


def side_hpsv3(out: Path) -> None:
    """A tiny HPSv3 in the authors' classes (hpsv3 1.0.0's `create_model_and_processor`,
    Qwen2VLRewardModelBT), saved as HPSv3.safetensors, loaded and scored by
    `HPSv3RewardInferencer`. Its config is HPSv3_7B.yaml with the tiny base as
    model_name_or_path, in fp32 (bf16/torch_dtype off: the CPU comparison is exact there)."""
    _side_imports()
    import safetensors.torch
    import torch
    import yaml
    from hpsv3.dataset.data_collator_qwen import INSTRUCTION
    from hpsv3.inference import _MODEL_CONFIG_PATH, HPSv3RewardInferencer
    from hpsv3.train import create_model_and_processor
    from hpsv3.utils.parser import (
        DataConfig,
        ModelConfig,
        PEFTLoraConfig,
        TrainingConfig,
        parse_args_with_yaml,
    )

    torch.set_num_threads(1)
    images = _images()
    work = Path(tempfile.mkdtemp())
    base = work / "Qwen2-VL-tiny"
    _hpsv3_base(base, INSTRUCTION)
    config = yaml.safe_load((_MODEL_CONFIG_PATH / "HPSv3_7B.yaml").read_text())
    config.update(model_name_or_path=str(base), bf16=False, torch_dtype="float32")
    config_path = work / "HPSv3_tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # The authors' model as their inferencer builds it (base weights, <|Reward|> added, head),
    # its weights then set to a scale at which the image and every token matter; saved as the
    # checkpoint the inferencer loads.
    (_, training_args, model_config, lora_config), _ = parse_args_with_yaml(
        (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), str(config_path),
        is_train=False)
    torch.manual_seed(7)
    model, _, _ = create_model_and_processor(model_config=model_config,
                                             peft_lora_config=lora_config,
                                             training_args=training_args)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, (p[0].numel()) ** -0.5)
            else:
                p.add_(0.1 * torch.randn_like(p))
    directory = out / "hpsv3"
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint = directory / "HPSv3.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(checkpoint))
    inferencer = HPSv3RewardInferencer(str(config_path), str(checkpoint), device="cpu")
    with torch.no_grad():
        scores = [inferencer.reward([_pil(images[name])] * len(PROMPTS), PROMPTS)[:, 0].tolist()
                  for name in IMAGE_SIZES]
        batch = inferencer.prepare_batch([_pil(images["square"])] * len(PROMPTS), PROMPTS)
    for name in ("config.json", "preprocessor_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.json"):
        if (base / name).exists():
            shutil.copy(base / name, directory / name)
    golden = {"scores": scores, "input_ids": batch["input_ids"].tolist(),
              "image_grid_thw": batch["image_grid_thw"].tolist()}
    (directory / "golden.json").write_text(json.dumps(golden, sort_keys=True) + "\n")
    shutil.rmtree(work)


def _compat(out: Path, flow_grpo: Path, dance_grpo: Path, gcpo: Path) -> None:
    """Each project's step function on fixed fp32 inputs with a given prev_sample: log-probs and
    the gradients of their sum with respect to the model output and the latents."""
    import math
    from typing import Optional, Union

    import torch
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteScheduler,
    )
    from diffusers.utils.torch_utils import randn_tensor

    namespace = {"torch": torch, "math": math, "Optional": Optional, "Union": Union,
                 "randn_tensor": randn_tensor,
                 "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler}
    functions = {
        "sde_step_with_logprob": load_function(flow_grpo, "sde_step_with_logprob", namespace),
        "flux_step": load_function(dance_grpo, "flux_step", namespace),
        "flow_grpo_step": load_function(gcpo, "flow_grpo_step", namespace),
    }
    g = torch.Generator().manual_seed(4)
    shape = (3, 4, 4, 8)  # [B, C, H, W]: Flow-GRPO views sigma as [B, 1, 1, 1]
    x, v, e = (torch.randn(shape, generator=g) for _ in range(3))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.clone()
    golden = {"latents": x, "model_output": v, "noise": e, "sigmas": sigmas,
              "timesteps": scheduler.timesteps.clone(), "eta": 0.7, "cases": {}}
    for name, fn in functions.items():
        for index in (0, 4, 8):
            xs, vs = x.clone().requires_grad_(), v.clone().requires_grad_()
            # A prev_sample near the step's own mean: the step of the ODE plus noise.
            s, s_next = sigmas[index], sigmas[index + 1]
            prev = (x + (s_next - s) * v + 0.3 * math.sqrt(s - s_next) * e).detach()
            if name == "sde_step_with_logprob":
                timestep = scheduler.timesteps[[index] * shape[0]]
                result = fn(scheduler, vs, timestep, xs, noise_level=0.7, prev_sample=prev)
                log_prob = result[1]
            else:
                extra = {"grpo": True, "sde_solver": True} if name == "flux_step" else {}
                result = fn(vs, xs, 0.7, sigmas, index, prev, **extra)
                log_prob = result[2]
            grad_v, grad_x = torch.autograd.grad(log_prob.sum(), (vs, xs))
            golden["cases"][f"{name}/{index}"] = {
                "prev_sample": prev, "log_prob": log_prob.detach(), "grad_model_output": grad_v,
                "grad_latents": grad_x}
    torch.save(golden, out / "compat.pt")


def side_generate(args) -> None:
    hub = Path(tempfile.mkdtemp())  # an offline hub cache holding only the synthetic BERT vocab
    os.environ.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    _bert_vocab(hub)
    _side_imports()
    import clip
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bpe = out / "bpe_simple_vocab_16e6.txt.gz"
    shutil.copy(Path(clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz", bpe)
    images = _images()
    torch.save(images, out / "images.pt")
    golden = {"prompts": PROMPTS, "images": list(IMAGE_SIZES)}
    _hpsv2(out, images, golden)
    _hf_clip(out, bpe, images, golden)
    _imagereward(out, images, golden)
    shutil.rmtree(hub)
    (out / "golden.json").write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    _compat(out, Path(args.flow_grpo), Path(args.dance_grpo), Path(args.gcpo))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    venv = sub.add_parser("venv", help="build the side environments")
    venv.add_argument("--venv", type=Path, required=True)
    venv.add_argument("--hpsv3-venv", type=Path, help="hpsv3's own (transformers 4.45.2, trl)")
    for name in ("generate", "_side"):
        gen = sub.add_parser(name, help="write tests/fixtures/parity" if name == "generate"
                             else argparse.SUPPRESS)
        gen.add_argument("--venv", type=Path, required=name == "generate")
        gen.add_argument("--hpsv3-venv", type=Path, help="also write the HPSv3 fixtures")
        gen.add_argument("--flow-grpo", required=True, help="flow_grpo's sd3_sde_with_logprob.py")
        gen.add_argument("--dance-grpo", required=True, help="DanceGRPO's train_grpo_flux.py")
        gen.add_argument("--gcpo", required=True, help="GCPO's train_grpo_flux_pickscore.py")
        gen.add_argument("--out", default=str(OUT))
    side3 = sub.add_parser("_side_hpsv3", help=argparse.SUPPRESS)
    side3.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    if args.command == "venv":
        make_venv(args.venv)
        if args.hpsv3_venv:
            make_hpsv3_venv(args.hpsv3_venv)
    elif args.command == "generate":
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        out = str(Path(args.out).resolve())
        cmd = [str(args.venv / "bin" / "python"), str(Path(__file__).resolve()), "_side",
               "--flow-grpo", str(Path(args.flow_grpo).resolve()),
               "--dance-grpo", str(Path(args.dance_grpo).resolve()),
               "--gcpo", str(Path(args.gcpo).resolve()), "--out", out]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env, cwd="/")
        if args.hpsv3_venv:
            cmd = [str(args.hpsv3_venv / "bin" / "python"), str(Path(__file__).resolve()),
                   "_side_hpsv3", "--out", out]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, env=env, cwd="/")
    elif args.command == "_side_hpsv3":
        side_hpsv3(Path(args.out))
    else:
        side_generate(args)


if __name__ == "__main__":
    main()
