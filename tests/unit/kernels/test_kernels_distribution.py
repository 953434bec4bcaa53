"""grpo-kernels is its own distribution (grpo-kernels/): torch is its one requirement, it imports
nothing of chunk-grpo's stack, it runs without numpy or triton, its wheel carries the C source,
and chunk-grpo requires it by the folder's path, never by a name pip would look up on PyPI."""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "grpo-kernels"
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _run(code: str, *args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(KERNELS), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_pyproject_requires_torch_only():
    project = tomllib.loads((KERNELS / "pyproject.toml").read_text())["project"]
    assert project["name"] == "grpo-kernels"
    assert [Requirement(r).name for r in project["dependencies"]] == ["torch"]
    assert [Requirement(r).name for r in project["optional-dependencies"]["triton"]] == ["triton"]
    assert (KERNELS / project["readme"]).is_file()


# The kernels with the packages they must not need made unimportable: numpy and triton are
# optional, and nothing of chunk-grpo's own stack may be imported. Each call is checked against
# the plain torch reference, and the C library must have been built (not the eager fallback).
_STANDALONE = """
import sys, warnings
BLOCKED = ("numpy", "triton", "chunk_grpo", "diffusers", "transformers", "peft", "tensorboard")
for name in BLOCKED:
    sys.modules[name] = None
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy
import torch
import grpo_kernels as gk
import grpo_kernels.benchmark, grpo_kernels.compat, grpo_kernels.cpu_fused
assert grpo_kernels.__file__.startswith(sys.argv[1]), grpo_kernels.__file__

torch.manual_seed(0)
x, v, x_next = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
sigma = torch.tensor([0.9, 0.7, 0.5])
for backend in ("cpu_fused", "reference"):
    logp = gk.sde_step_logprob(x, v, x_next, sigma, 0.4, eta=0.7, backend=backend)
    loss, stats = gk.chunk_grpo_loss(torch.stack([logp, 2 * logp], 1),
                                     torch.stack([logp, logp], 1).detach() + 0.01,
                                     torch.tensor([1.0, -0.5, 0.25]), [1, 1],
                                     clip_low=0.2, clip_high=0.2, backend=backend)
    print(backend, *logp.tolist(), loss.item())
assert grpo_kernels.cpu_fused.library() is not None
try:
    gk.sde_step_logprob(x, v, x_next, 0.5, 0.6, eta=0.7)
except ValueError as err:
    print("error:", err)
loaded = {name.split(".")[0] for name in sys.modules if sys.modules[name] is not None}
print("loaded:", *sorted(loaded & set(BLOCKED)))
"""


def test_kernels_run_with_torch_alone(tmp_path):
    out = _run(_STANDALONE, str(KERNELS), cwd=tmp_path, GRPO_KERNELS_CACHE=str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    fused, reference = ([float(x) for x in line.split()[1:]] for line in lines[:2])
    assert lines[0].startswith("cpu_fused") and lines[1].startswith("reference")
    assert fused == pytest.approx(reference, rel=1e-5)
    assert lines[2] == ("error: sigma_next must satisfy 0 <= sigma_next < sigma (the step goes "
                        "towards the data), got sigma=[0.5, 0.5, 0.5], sigma_next=[0.6, 0.6, 0.6]")
    assert lines[3] == "loaded:"
    assert list(tmp_path.glob("sde_step-*.so"))  # built on first use, into the given cache


def test_triton_backend_without_triton_names_the_extra():
    code = ("import sys, torch; sys.modules['triton'] = None\n"
            "import grpo_kernels as gk\n"
            "x = torch.randn(2, 3)\n"
            "gk.sde_step_logprob(x, x, x, 0.5, 0.4, eta=0.7, backend='triton')\n")
    out = _run(code, TRITON_INTERPRET="1")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: backend='triton' needs the triton package: pip install "
        "'grpo-kernels[triton]' (torch's CUDA builds bring it), or use backend='cpu_fused' / "
        "'reference'")


def test_wheel_carries_the_c_source_and_requires_torch_only(tmp_path):
    # Built from a copy, so that the build leaves nothing in the checkout.
    source = shutil.copytree(KERNELS, tmp_path / "src",
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = _run("import sys; from setuptools import build_meta; "
               "print(build_meta.build_wheel(sys.argv[1]))", str(tmp_path), cwd=source)
    assert out.returncode == 0, out.stderr
    wheel = tmp_path / out.stdout.strip().splitlines()[-1]
    assert wheel.name.startswith("grpo_kernels-")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "grpo_kernels/csrc/sde_step.c" in names
    assert not any(n.startswith(("chunk_grpo/", "tests/")) for n in names)
    requires = [Requirement(line.split(":", 1)[1]) for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    required = [r.name for r in requires if r.marker is None]
    assert required == ["torch"]
    assert [(r.name, str(r.marker)) for r in requires if r.marker] == [
        ("triton", 'extra == "triton"')]


def _setup_module():
    spec = importlib.util.spec_from_file_location("chunk_grpo_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: setup() is not called
    return module


def test_chunk_grpo_requires_the_kernels_by_their_folder(tmp_path):
    setup = _setup_module()
    requirement = Requirement(setup.kernels_requirement())
    assert requirement.name == "grpo-kernels"
    assert requirement.url == KERNELS.as_uri()  # a direct reference: pip never asks PyPI
    assert all(Requirement(r).name != "grpo-kernels" for r in setup.DEPENDENCIES)
    with pytest.raises(SystemExit, match="grpo-kernels/pyproject.toml is missing"):
        setup.kernels_requirement(tmp_path)


def test_no_kernels_folder_shadows_hugging_face_kernels():
    # `kernels` is Hugging Face's kernel hub package, which transformers probes for.
    out = _run("import importlib.util; spec = importlib.util.find_spec('kernels'); "
               "print(spec.origin if spec else None)")
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    assert origin == "None" or not Path(origin).resolve().is_relative_to(ROOT)
    assert not (ROOT / "kernels").exists()
