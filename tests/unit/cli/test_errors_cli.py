"""Bad input to every command: one line on stderr, exit status 2, nothing left on disk; Ctrl-C:
exit status 130, one line naming the checkpoint, which resumes."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from trainer_utils import tiny_config

from chunk_grpo.cli.runner import run_command
from chunk_grpo.cli.train import main
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config, load_yaml
from chunk_grpo.models.sampling_defaults import CONFIG_NAME
from chunk_grpo.runtime import distributed as D
from chunk_grpo.runtime.quiet import quiet_third_party
from chunk_grpo.shapes import HELDOUT_PROMPTS_FILE
from chunk_grpo.train.checkpoint import DiskFullError, checkpoint_problem, latest_checkpoint
from chunk_grpo.train.loop import TrainingDiverged, _checkpoint, run
from chunk_grpo.train.run_lock import RunLock
from chunk_grpo.train.setup import build_trainer

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

ROOT = Path(__file__).resolve().parents[3]


def _cli(args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- subprocesses

@pytest.mark.parametrize("args, message", [
    (["chunk_grpo.train", "--lerning-rate", "1"], "unknown config key 'lerning_rate'"),
    (["chunk_grpo.train", "--chunks.spec", "-1,4"], "chunks.spec: chunk sizes must be >= 1"),
    (["chunk_grpo.train", "--optim.lr", "nan"], "lr must be a finite number"),
    (["chunk_grpo.train", "--optim.lr=nan"], "optim.lr must be a finite number"),
    (["chunk_grpo.train", "--optim.lrr", "1"], "'optim.lrr' in the command line; did you mean "
                                               "'optim.lr'?"),
    (["chunk_grpo.evaluate", "--images-per-prompt", "0"], "--images-per-prompt: must be >= 1"),
    (["chunk_grpo.evaluate", "--sampling.batch_size", "0"], "sampling.batch_size must be >= 1"),
    (["chunk_grpo.evaluate", "--sampling.eta", "nan"], "sampling.eta must be a finite number"),
    (["chunk_grpo.evaluate", "--max-prompts", "0"], "--max-prompts: must be >= 1"),
    (["chunk_grpo.evaluate", "--model", "DIR"], "--model is a section; set its keys, e.g. "
                                                "--model.name VALUE"),
    (["chunk_grpo.credit", "--sampling.group_size", "1", "--loss.adv_norm", "none"],
     "sampling.group_size must be >= 2 to measure a spread"),
    (["chunk_grpo.credit", "--kind", "dance"], "did you mean 'sampling.sde'?"),
    (["chunk_grpo.profile", "--sampling.steps", "1"], "sampling.steps must be >= 2"),
    (["chunk_grpo.profile", "--num-steps", "8"], "did you mean 'sampling.steps'?"),
    (["chunk_grpo.reward_server", "--reward", "shapes", "--port", "0"],
     "--reward is a section; set its keys, e.g. --reward.name VALUE"),
    (["chunk_grpo.reward_server", "--port", "0"], "--reward.name is required"),
    (["chunk_grpo.reward_server", "--reward.name", "shapes", "--reward.device", "gpu",
      "--port", "0"], "reward.device must be '' (the reward's own default), cpu, cuda"),
    (["chunk_grpo.evaluate_clip", "--seed", "1"], "did you mean 'run.seed'?"),
    (["chunk_grpo.evaluate_clip", "--group", "1"], "--group must be >= 2"),
    (["chunk_grpo.pretrain", "--out", "x", "--steps", "0"], "--steps: must be >= 1"),
    (["chunk_grpo.gradient_snr", "--first-step", "-2"], "--first-step: must be >= 0"),
])
def test_bad_flags_are_one_line_and_status_2(tmp_path, args, message):
    start = time.perf_counter()
    result = _cli(args, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert time.perf_counter() - start < 30  # parsed before the model: no sampling started


def test_help_answers_before_the_heavy_imports(tmp_path):
    result = _cli(["chunk_grpo.train", "--help"], tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    imports = subprocess.run([sys.executable, "-X", "importtime", "-m", "chunk_grpo.evaluate",
                              "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and "--optim.lr" in result.stdout
    assert imports.returncode == 0 and "--sampling.batch_size" in imports.stdout
    loaded = {line.split("|")[-1].strip() for line in imports.stderr.splitlines()}
    assert not loaded & {"torch", "diffusers", "transformers"}


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("optim.lr: 1e-3\nchunks.spec: [2, 3\nsampling.group_size: 4\n")
    with pytest.raises(ConfigError, match=r"preset.yaml' line 3, column \d+ is not valid YAML"):
        load_yaml(path)
    path.write_bytes("lr: 1e-3\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot read config file .* as UTF-8"):
        load_yaml(path)


@pytest.mark.parametrize("key, value, message", [
    ("optim.lr", "inf", "optim.lr must be a finite number"),
    ("optim.lr", -1e-3, "optim.lr must be > 0"),
    ("loss.kl_coef", "nan", "loss.kl_coef must be a finite number"),
    ("loss.kl_coef", -0.1, "loss.kl_coef must be >= 0"),
    ("optim.beta2", 1.0, r"optim.beta2 must be in \[0, 1\)"),
    ("sampling.shift", 0.0, "sampling.shift must be > 0"),
    ("run.max_minutes", "inf", "run.max_minutes must be a finite number"),
    ("model.height", 8, "model.height must be >= 16 pixels"),
])
def test_numeric_fields_are_finite_and_in_range(key, value, message):
    with pytest.raises(ConfigError, match=message):
        build_config(None, {key: value})


# ----------------------------------------------------------------------------- train, in-process

@pytest.fixture(scope="module")
def model(tiny_flux):
    return tiny_flux


@pytest.fixture
def quiet(monkeypatch):
    """As the commands run: third-party bars and warnings hidden (stderr holds our line)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY",
                 "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.delenv(name, raising=False)
    quiet_third_party()
    yield
    diffusers_logging.enable_progress_bar()
    transformers_logging.enable_progress_bar()


def _one_line_exit(capsys, argv) -> tuple[int, str]:
    argv = [*argv, "--eval.hybrid_steps", "0"]  # the tiny model samples 5 steps
    with pytest.raises(SystemExit) as exit_info:
        run_command(lambda: main(argv), "train", errors=(TrainingDiverged,))
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return exit_info.value.code, err


def _prompt_case(tmp_path, case):
    path = tmp_path / "prompts.txt"
    good = HELDOUT_PROMPTS_FILE.read_text().splitlines()[0]
    if case == "empty":
        path.write_text("")
        return path, "has no prompts"
    if case == "comments-only":
        path.write_text("# nothing\n\n")
        return path, "has no prompts"
    if case == "missing":
        return tmp_path / "nowhere.txt", "does not exist"
    if case == "latin-1":
        path.write_bytes(f"{good}\nun caf\u00e9\n".encode("latin-1"))
        return path, "is not UTF-8 text"
    path.write_text(f"{good}\n{good} \U0001F600\n")  # shapes cannot score it
    return path, "line 2: the reward cannot score"


@pytest.mark.parametrize("which", ["train_prompts", "eval_prompts"])
@pytest.mark.parametrize("case", ["empty", "comments-only", "missing", "latin-1", "refused"])
def test_bad_prompt_files_stop_before_the_run_directory(tmp_path, capsys, model, quiet, which,
                                                        case):
    path, message = _prompt_case(tmp_path, case)
    out = tmp_path / "run"
    flag = f"--data.{which}"
    code, err = _one_line_exit(capsys, ["--model.name", str(model), "--reward.name", "shapes",
                                        "--run.output_dir", str(out), flag, str(path)])
    assert code == 2 and f"data.{which}: " in err and message in err
    assert not out.exists()


def test_a_model_without_sampling_settings_needs_a_size(tmp_path, capsys, model, quiet):
    bare = tmp_path / "bare"
    bare.mkdir()
    for item in model.iterdir():
        if item.name != CONFIG_NAME:
            os.symlink(item, bare / item.name)
    out = tmp_path / "run"
    code, err = _one_line_exit(capsys, ["--model.name", str(bare), "--reward.name",
                                        "test_brightness", "--run.output_dir", str(out)])
    assert code == 2 and f"no {CONFIG_NAME}" in err and "--model.height H --model.width W" in err
    assert not out.exists()


def test_an_unwritable_output_directory_is_one_line(tmp_path, capsys, model, quiet):
    (tmp_path / "file").write_text("in the way")
    code, err = _one_line_exit(capsys, ["--model.name", str(model), "--reward.name",
                                        "test_brightness", "--run.output_dir",
                                        str(tmp_path / "file" / "run")])
    assert code == 2 and "cannot write the output directory" in err


def test_a_locked_run_directory_is_refused(tmp_path, model):
    out = tmp_path / "run"
    out.mkdir()
    with RunLock(out), pytest.raises(Exception, match="is in use by another run"):
        run(tiny_config(model, out))
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no config, no metrics


def test_nan_weights_are_never_checkpointed(tmp_path, model):
    tr = build_trainer(tiny_config(model, tmp_path / "run"), tmp_path / "run", D.DistInfo())
    _checkpoint(tr, 1, 0)
    with torch.no_grad():
        next(p for p in tr.params).view(-1)[0] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"1 trained tensor\(s\) \(e.g. .*\) hold NaN/Inf "
                                               r"at step 2; .* last good checkpoint is .*"
                                               r"step-00000001"):
        _checkpoint(tr, 2, 0)
    assert latest_checkpoint(tmp_path / "run").name == "step-00000001"


@pytest.mark.slow  # a real process: start-up, one iteration, then a resumed iteration
def test_ctrl_c_exits_130_naming_a_resumable_checkpoint(tmp_path, model):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["--model.name", str(model), "--reward.name", "test_brightness", "--run.output_dir",
            str(out), "--sampling.steps", "5", "--sampling.group_size", "4",
            "--sampling.prompts_per_step", "2", "--chunks.spec", "2,2", "--run.max_steps", "1000",
            "--run.checkpoint_every", "1", "--eval.hybrid_steps", "0", "--eval.every", "0",
            "--run.progress", "false", "--model.lora_rank", "0", "--model.mixed_precision", "no",
            "--run.max_minutes", "0", "--sampling.sde_window", "0"]
    # the test reward lives in the tests: register it in the child before the CLI runs
    code = ("import sys, runpy; from chunk_grpo.runtime.quiet import quiet_third_party; "
            "quiet_third_party(); sys.path.insert(0, 'tests'); "
            "from trainer_utils import Brightness; from chunk_grpo.rewards import register_reward; "
            "register_reward('test_brightness')(Brightness); "
            "sys.argv = ['chunk_grpo.train'] + sys.argv[1:]; "
            "runpy.run_module('chunk_grpo.train', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while latest_checkpoint(out) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted (Ctrl-C); resume from" in lines[0], err
    last = latest_checkpoint(out)
    assert checkpoint_problem(last) is None and str(last) in lines[0]
    step = int(last.name.split("-")[1])
    run(build_config(out / "config.yaml", {"run.max_steps": step + 1}), run_dir=out, resume=True)
    assert latest_checkpoint(out).name == f"step-{step + 1:08d}"


@pytest.mark.parametrize("extra, message", [
    (["--compare", "nowhere"], "--compare nowhere: no samples.jsonl there"),
    (["--hybrid-base", "MODEL", "--eval.hybrid_steps", "99"],
     "eval.hybrid_steps 99 exceeds the 2"),
    (["--eval.hybrid_steps", "2"], "eval.hybrid_steps needs --hybrid-base"),
])
def test_evaluate_argument_cases_are_config_errors(tmp_path, model, extra, message):
    from chunk_grpo.cli.evaluate import main as evaluate_main

    extra = [str(model) if word == "MODEL" else word for word in extra]
    with pytest.raises(ConfigError, match=message):
        evaluate_main(["--model.name", str(model), "--out", str(tmp_path / "ev"),
                       "--sampling.steps", "2", "--max-prompts", "1", *extra])
    assert not (tmp_path / "ev").exists()


def test_evaluate_checks_its_prompts_before_sampling(tmp_path, model):
    from chunk_grpo.cli.evaluate import main as evaluate_main

    path, message = _prompt_case(tmp_path, "refused")
    with pytest.raises(ConfigError, match=message):
        evaluate_main(["--model.name", str(model), "--out", str(tmp_path / "ev"),
                       "--sampling.steps", "2", "--data.eval_prompts", str(path)])
    assert not (tmp_path / "ev").exists()


def test_a_full_disk_at_export_keeps_the_checkpoint_and_says_how_to_finish(tmp_path, model,
                                                                            monkeypatch):
    import chunk_grpo.train.run_eval as trainer_eval

    def no_space(tr):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "run"
    monkeypatch.setattr(trainer_eval, "export_final", no_space)
    with pytest.raises(DiskFullError, match=r"no space left on device to export .*final_model; "
                                            r"the summary and the last checkpoint "
                                            r".*step-00000001 are kept"):
        run(tiny_config(model, out, {"run.max_steps": 1}))
    assert checkpoint_problem(latest_checkpoint(out)) is None
    monkeypatch.undo()
    run(build_config(out / "config.yaml"), run_dir=out, resume=True)  # exports, trains nothing
    assert (out / "final_model" / "model_index.json").is_file()


def test_a_diverged_run_and_one_that_trained_nothing_are_one_line_errors():
    from chunk_grpo.cli.runner import _loaded_one_line_errors
    from chunk_grpo.train.loop import NothingTrained

    kinds = _loaded_one_line_errors()
    assert TrainingDiverged in kinds and NothingTrained in kinds
