"""The commands start quiet: nothing from third-party packages on stderr unless --verbose."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunk_grpo.cli.main import COMMANDS as CLI_COMMANDS

ROOT = Path(__file__).resolve().parents[3]
# Every `python -m chunk_grpo.<command>`
COMMANDS = sorted(f"chunk_grpo.{command.module}" for command in CLI_COMMANDS.values())
BNB_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_LINE = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
            "already `pip install kernels` and the kernels >= 0.11.1")


def _python(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)


def test_every_command_is_found():
    assert {"chunk_grpo.train", "chunk_grpo.evaluate", "chunk_grpo.ablate",
            "chunk_grpo.evaluate_clip"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_prints_nothing_on_stderr(tmp_path, command):
    """Some commands import transformers, diffusers and peft (which imports bitsandbytes) before
    parsing their flags; whatever those print as they load must not reach the user."""
    result = _python(["-m", command, "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and "usage:" in result.stdout


def test_bitsandbytes_import_line_is_dropped_and_its_other_warnings_kept(tmp_path):
    """The filter sits on bitsandbytes' own logger before bitsandbytes is imported (a real import
    prints the line only on CPUs with AVX512-BF16, so the record is also emitted directly)."""
    code = ("import logging, sys; from chunk_grpo.runtime.quiet import quiet_third_party; "
            "quiet_third_party('--verbose' in sys.argv); import bitsandbytes; "
            f"log = logging.getLogger({BNB_LOGGER!r}); "
            f"log.warning({BNB_LINE!r}, \"No module named 'kernels'\"); "
            "log.warning('another bitsandbytes warning')")
    quiet = _python(["-c", code], tmp_path)
    verbose = _python(["-c", code, "--verbose"], tmp_path)
    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert quiet.stderr.splitlines() == ["another bitsandbytes warning"], quiet.stderr
    assert "kernels-community" in verbose.stderr  # --verbose shows it
    assert "another bitsandbytes warning" in verbose.stderr
