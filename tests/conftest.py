import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

# Triton JIT-decorates kernels at import: the interpreter flag must be set before that, so the
# Triton kernels can run (slowly, on small shapes) on CPU-only machines.
os.environ.setdefault("TRITON_INTERPRET", "1")


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(directory)): (f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(directory.rglob("*"))}


@pytest.fixture(scope="session")
def tiny_flux_seed(tmp_path_factory) -> Iterator[Callable[[int], Path]]:
    """``seed -> directory`` of the tiny random FLUX (trainer_utils.tiny_model_dir) built with
    that seed, each built once per test run and shared by every test. Tests must not write
    into it (checked at the end of the run): take `tiny_flux_copy` to change a model
    directory."""
    built: dict[int, tuple[Path, dict]] = {}

    def model(seed: int = 0) -> Path:
        from trainer_utils import tiny_model_dir  # imported late: after TRITON_INTERPRET is set

        if seed not in built:
            path = tiny_model_dir(tmp_path_factory.mktemp(f"tiny-flux-{seed}"), seed)
            built[seed] = path, _files(path)
        return built[seed][0]

    yield model
    changed = [str(path) for path, files in built.values() if _files(path) != files]
    assert not changed, (f"a test changed the shared tiny FLUX in {changed}; take the "
                         "tiny_flux_copy fixture to change a model directory")


@pytest.fixture(scope="session")
def tiny_flux(tiny_flux_seed) -> Path:
    """The tiny random FLUX (seed 0), built once per test run; read-only."""
    return tiny_flux_seed(0)


@pytest.fixture
def tiny_flux_copy(tiny_flux, tmp_path) -> Path:
    """A private copy of `tiny_flux` for a test that changes files in the model directory."""
    return Path(shutil.copytree(tiny_flux, tmp_path / "tiny-flux-copy"))


@pytest.fixture
def register_test_reward() -> Iterator[Callable]:
    """``register(name, factory)``: a toy reward registered until the test ends."""
    from trainer_utils import registered_rewards

    with ExitStack() as stack:
        def register(name: str, factory: Callable) -> Callable:
            stack.enter_context(registered_rewards(**{name: factory}))
            return factory

        yield register


@pytest.fixture
def brightness_reward(register_test_reward) -> str:
    """The toy reward "test_brightness" (trainer_utils.Brightness, the default reward of
    trainer_utils.tiny_config) registered for the test; its name."""
    from trainer_utils import Brightness

    register_test_reward("test_brightness", Brightness)
    return "test_brightness"
