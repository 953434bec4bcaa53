"""`chunk-grpo`: one command with a subcommand per job. Every `python -m chunk_grpo.<command>`
that the documentation names runs the same command, and `--help` answers before torch loads."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chunk_grpo.cli.main import COMMANDS, main

ROOT = Path(__file__).resolve().parents[3]
HELP = ("import sys, time; start = time.perf_counter(); from chunk_grpo.cli.main import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    code = done.code\n"
        "print(code, 'torch' in sys.modules, time.perf_counter() - start, file=sys.stderr)")


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_console_script_is_the_dispatcher():
    assert 'chunk-grpo = "chunk_grpo.cli.main:main"' in (ROOT / "pyproject.toml").read_text()


def test_every_documented_python_m_command_is_a_command():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {m for path in docs if path.is_file()
             for m in re.findall(r"python -m chunk_grpo\.([\w.]*\w)", path.read_text())}
    modules = {command.module for command in COMMANDS.values()}
    commands = {m for m in named if "." not in m}
    assert commands and commands <= modules, commands - modules
    for module in named - commands:  # a module run as a script (shapes.prompt_sets)
        assert importlib.util.find_spec(f"chunk_grpo.{module}") is not None, module
    for module in modules:  # a shim or a subpackage with a __main__.py
        spec = importlib.util.find_spec(f"chunk_grpo.{module}")
        assert spec is not None, module
        if spec.submodule_search_locations:
            assert importlib.util.find_spec(f"chunk_grpo.{module}.__main__") is not None, module
        assert importlib.util.find_spec(f"chunk_grpo.cli.{module}") is not None, module


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["evaluate", "--help"],
                                  ["plan", "--help"], ["gradient_snr", "--help"],
                                  ["credit", "--help"], ["profile", "--help"],
                                  ["reward-server", "--help"], ["evaluate-clip", "--help"]])
def test_help_answers_at_once_without_torch(args):
    result = _python("-c", HELP, *args)
    code, torch_loaded, seconds = result.stderr.split()[-3:]
    assert code in ("0", "None") and torch_loaded == "False", result.stderr
    assert float(seconds) < 3 and "usage:" in result.stdout


def test_python_m_train_help_answers_at_once_without_torch():
    code = ("import runpy, sys, time; start = time.perf_counter(); sys.argv = ['x', '--help']\n"
            "try:\n    runpy.run_module('chunk_grpo.train', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('torch' in sys.modules, time.perf_counter() - start, file=sys.stderr)")
    start = time.perf_counter()
    result = _python("-c", code)
    assert result.stderr.split()[-2] == "False", result.stderr
    assert float(result.stderr.split()[-1]) < 3 and "--optim.lr" in result.stdout
    assert time.perf_counter() - start < 10  # the interpreter's own start-up included


def test_the_commands_are_listed_and_an_unknown_one_is_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert all(re.search(rf"^  {re.escape(name)} +\S", out, re.M) for name in COMMANDS)
    with pytest.raises(SystemExit) as done:
        main(["trian", "--optim.lr", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1
    assert "unknown command 'trian'; did you mean 'train'?" in err[0]
    with pytest.raises(SystemExit) as done:
        main([])
    assert done.value.code == 2 and "commands:" in capsys.readouterr().err


def test_a_bad_flag_is_one_line_naming_the_subcommand():
    result = _python("-m", "chunk_grpo.cli", "train", "--optim.lr=nan")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("chunk-grpo train: error: ")
    assert "optim.lr must be a finite number" in lines[0]
