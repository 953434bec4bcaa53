"""chunk-grpo's dependencies; every other piece of metadata is in pyproject.toml.

They are computed here for one reason: the fused kernels are their own distribution,
grpo-kernels, in the folder grpo-kernels/ beside this file, and not on PyPI. A requirement can
name a local folder only by an absolute file:// URL (PEP 508 has no relative form), so the URL is
built from where this file lies; a requirement by name alone would send pip to PyPI for it.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def kernels_requirement(root: Path = ROOT) -> str:
    """The grpo-kernels requirement: a direct reference to the folder beside this file."""
    kernels = root / "grpo-kernels"
    if not (kernels / "pyproject.toml").is_file():
        raise SystemExit(
            f"chunk-grpo: {kernels}/pyproject.toml is missing; install chunk-grpo from a checkout "
            "of its repository (pip install PATH_TO_CHECKOUT), which holds grpo-kernels/ beside "
            "setup.py, not from an sdist"
        )
    return f"grpo-kernels @ {kernels.as_uri()}"


DEPENDENCIES = [
    # A range, so that a GPU machine keeps the torch built for its CUDA; the exact versions CI
    # installs (the CPU build of torch) are in constraints/ci.txt. 2.9: FSDP2 over gloo (the
    # CPU ranks of tests/test_parallelize.py) fails in 2.6 (CUDA stream events) and gives the
    # sum, not the mean, of the ranks' gradients in 2.7 and 2.8; 2.6 is the first release with
    # `torch.distributed.fsdp.fully_shard` and `torch.nn.utils.get_total_norm` public.
    "torch>=2.9",
    # with transformers 5: diffusers 0.35.0-0.35.1 import transformers.utils.FLAX_WEIGHTS_NAME
    # and peft 0.17 transformers.HybridCache, both gone in transformers 5
    "diffusers>=0.35.2",
    # 5.4: the PIL image processors (Qwen2VLImageProcessorPil, HPSv3) and
    # transformers.initialization.no_init_weights
    "transformers>=5.4",
    "tokenizers>=0.22",
    "sentencepiece>=0.2",
    "safetensors>=0.4",
    "peft>=0.18",
    "numpy>=1.26",
    "scipy>=1.10",
    "pillow>=10",
    "pyyaml>=6",
    "draccus>=0.11,<0.12",  # the config: YAML and --section.key flags into the dataclasses
    "tqdm>=4.66",
    "tensorboard>=2.16",
    "protobuf>=4",
    # The prompt cleaning of OpenAI's and open_clip's CLIP tokenizers (hpsv2 and clip rewards).
    "ftfy>=6.1",
    "regex>=2022.1",
]

if __name__ == "__main__":  # as setuptools runs it; a test imports the lists above
    setup(install_requires=[kernels_requirement(), *DEPENDENCIES])
