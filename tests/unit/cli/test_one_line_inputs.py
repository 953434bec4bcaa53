"""Inputs that were resolved silently or failed with a traceback: one line, exit status 2, no run
directory. A key given twice in a YAML file (in one mapping, or dotted and nested, or by its
alias and its path), chunk sizes given twice, an SDE window beyond the steps, parallelism none
on two ranks, a disk that fills up at a mid-run checkpoint."""

import errno

import pytest
from spawn_ranks import run_ranks
from trainer_utils import tiny_config

from chunk_grpo.cli.runner import _loaded_one_line_errors, run_command
from chunk_grpo.cli.train import main
from chunk_grpo.train.loop import run

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")


def _one_line(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: main(argv), "prog", errors=_loaded_one_line_errors)
    # (third-party progress bars aside: `run_cli` quiets them under python -m)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "prog:" in line or "Traceback" in line]
    assert stop.value.code == 2 and len(lines) == 1, err
    assert lines[0].startswith("prog: error: ")
    return lines[0]


@pytest.mark.parametrize("text, message", [
    ("optim:\n  lr: 1e-3\noptim:\n  lr: 2e-3\n",
     "line 3, column 1 gives the key 'optim' a second time in one mapping; give it once"),
    ("optim:\n  lr: 1e-3\n  lr: 2e-3\n",
     "line 3, column 3 gives the key 'lr' a second time in one mapping"),
    ("optim.lr: 1e-3\noptim:\n  lr: 2e-3\n", "optim.lr is given twice in {path}; give it once"),
    ("lr: 1e-3\noptim.lr: 2e-3\n", "unknown config key 'lr' in {path}; did you mean 'optim.lr'?"),
])
def test_a_key_given_twice_in_yaml_is_refused(tmp_path, capsys, text, message):
    path = tmp_path / "preset.yaml"
    path.write_text(text + f"run.output_dir: {tmp_path / 'run'}\n")
    assert message.format(path=path) in _one_line(["--config", str(path)], capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--chunks.spec", "1,3", "--chunks.size", "2"],
     "chunks.spec '1,3' and chunks.size 2 both set the chunk layout; give one of them"),
    (["--sampling.sde_window", "10", "--sampling.steps", "4"],
     "sampling.sde_window 10 is beyond the 4 sampling steps (sampling.steps); give at most 3"),
])
def test_contradicting_or_out_of_range_settings_are_refused(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert message in _one_line(["--run.output_dir", str(out), *flags], capsys)
    assert not out.exists()


def test_a_full_disk_at_a_mid_run_checkpoint_is_one_line(tiny_flux, tmp_path, capsys, monkeypatch):
    import chunk_grpo.train.checkpoint as ckpt

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", no_space)
    model, out = tiny_flux, tmp_path / "run"
    line = _one_line(["--model.name", str(model), "--run.output_dir", str(out), "--run.max_steps",
                      "2", "--run.checkpoint_every", "1", "--sampling.group_size", "2",
                      "--sampling.prompts_per_step", "1", "--eval.images", "2",
                      "--eval.final_images", "2", "--sampling.steps", "3",
                      "--sampling.sde_window", "3", "--eval.hybrid_steps", "0", "--run.progress",
                      "false", "--run.image_grid_every", "0"], capsys)
    assert "no space left on device for a checkpoint in" in line


def _parallelism_none(rank: int, world: int, tmp, model) -> str:
    from chunk_grpo.runtime.parallelize import ParallelismError

    with pytest.raises(ParallelismError) as refused:
        run(tiny_config(model, tmp / "run", {"parallel.mode": "none"}))
    assert ParallelismError in _loaded_one_line_errors()
    return str(refused.value)


def test_parallelism_none_on_two_ranks_is_refused_before_the_model(tiny_flux, tmp_path,
                                                                   monkeypatch):
    from chunk_grpo.train import loop as train

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train, "build_policy", never)  # inherited by the forked ranks
    model = tiny_flux
    messages = run_ranks(_parallelism_none, 2, tmp_path, model)
    assert messages[0] == messages[1]
    assert messages[0].startswith("parallelism 'none' runs one process, but this job has 2 ranks")
    assert not (tmp_path / "ranks-_parallelism_none-2" / "run").exists()
