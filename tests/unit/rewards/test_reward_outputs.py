"""A user's reward returning something bad: converted, a clear error naming the reward, or a
logged and skipped step; and nothing lost."""

import pytest
import torch
from trainer_utils import tiny_config

from chunk_grpo.cli.runner import run_command
from chunk_grpo.rewards import RewardOutputError, get_reward
from chunk_grpo.rewards.outputs import call_reward, check_reward_output
from chunk_grpo.rewards.registry import RewardLoadError
from chunk_grpo.train.checkpoint import latest_checkpoint, load_checkpoint
from chunk_grpo.train.loop import NothingTrained, TrainingDiverged, run
from chunk_grpo.train.metrics import read_metrics


def _brightness(images):
    return images.float().mean(dim=(1, 2, 3))


BAD_OUTPUTS = {
    "list": lambda images, prompts: _brightness(images).tolist(),
    "numpy": lambda images, prompts: _brightness(images).double().numpy(),
    "int_tensor": lambda images, prompts: (_brightness(images) * 100).long(),
    "wrong_length": lambda images, prompts: _brightness(images)[:-1],
    "column": lambda images, prompts: _brightness(images)[:, None],
    "scalar": lambda images, prompts: float(_brightness(images).mean()),
    "strings": lambda images, prompts: ["good"] * len(prompts),
    "none": lambda images, prompts: None,
    "dict": lambda images, prompts: {"score": _brightness(images)},
}


@pytest.mark.parametrize("kind", ["list", "numpy", "int_tensor"])
def test_numbers_in_a_list_or_array_are_converted(kind):
    images = torch.rand(3, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    got = call_reward(kind, BAD_OUTPUTS[kind], images, ["a", "b", "c"])
    assert got.dtype == torch.float32 and got.shape == (3,)
    want = _brightness(images) * (100 if kind == "int_tensor" else 1)
    torch.testing.assert_close(got, want.long().float() if kind == "int_tensor" else want)


@pytest.mark.parametrize("kind, described", [
    ("wrong_length", "a tensor of shape (2,)"), ("column", "a tensor of shape (3, 1)"),
    ("scalar", "float "), ("strings", "a list of 3 items ['good'"), ("none", "NoneType None"),
    ("dict", "dict {'score'"),
])
def test_wrong_outputs_name_the_reward_and_what_it_returned(kind, described):
    images = torch.rand(3, 3, 4, 4)
    with pytest.raises(RewardOutputError) as err:
        call_reward(f"my_{kind}", BAD_OUTPUTS[kind], images, ["a", "b", "c"])
    message = str(err.value)
    assert message.startswith(f"reward 'my_{kind}' returned {described}")
    assert "a float tensor of shape [3]" in message and "\n" not in message


def test_an_exception_inside_a_reward_is_named_and_chained():
    def broken(images, prompts):
        raise ZeroDivisionError("division by zero\nsecond line")

    with pytest.raises(RewardOutputError, match=r"^reward 'broken' raised ZeroDivisionError "
                                                r"while scoring 2 images: division by zero;") as e:
        call_reward("broken", broken, torch.rand(2, 3, 4, 4), ["a", "b"])
    assert isinstance(e.value.__cause__, ZeroDivisionError) and "\n" not in str(e.value)
    # NaN is a number: it passes here and the trainer skips the step.
    assert torch.isnan(check_reward_output("nan", [float("nan"), 1.0], 2)[0])


# ----------------------------------------------------------------------------- in a run

class CallCounting:
    """Brightness, with a behaviour switched on from the N-th call (call 1 is the start-up
    probe, call 2 scores step 1, ...)."""

    calls = 0
    mode = "ok"
    from_call = 1

    def __call__(self, images, prompts):
        CallCounting.calls += 1
        r = _brightness(images)
        if CallCounting.calls < CallCounting.from_call:
            return r
        if CallCounting.mode == "nan":
            return r * float("nan")
        if CallCounting.mode == "constant":
            return torch.full_like(r, 0.5)
        if CallCounting.mode == "raise":
            raise RuntimeError("the reward model ran out of memory")
        return BAD_OUTPUTS[CallCounting.mode](images, prompts)


@pytest.fixture(autouse=True)
def toy_rewards(register_test_reward, brightness_reward):
    """This module's toy rewards, registered for each of its tests."""
    register_test_reward("test_call_counting", CallCounting)


def _error_line(stderr: str) -> str:
    """The one error line (stderr also holds the model loader's progress bars)."""
    assert stderr.count("prog: error:") == 1
    line = stderr.splitlines()[-1]
    assert line.startswith("prog: error: ")
    return line


def _config(model, tmp_path, mode, from_call=1, overrides: dict | None = None):
    CallCounting.calls, CallCounting.mode, CallCounting.from_call = 0, mode, from_call
    return tiny_config(model, tmp_path / "run", {"reward.name": "test_call_counting",
                                                  **(overrides or {})})


@pytest.mark.parametrize("mode, outcome", [
    ("list", "trains"), ("numpy", "trains"), ("constant", "warns once"),
    ("nan", "stops before the run"), ("wrong_length", "stops before the run"),
    ("strings", "stops before the run"), ("raise", "stops before the run"),
])
def test_bad_outputs_in_a_run(tiny_flux, tmp_path, capsys, mode, outcome):
    cfg = _config(tiny_flux, tmp_path, mode, overrides={"run.max_steps": 2,
                                                        "run.checkpoint_every": 1,
                                                        "run.max_bad_steps": 5})
    capsys.readouterr()
    if outcome == "stops before the run":
        with pytest.raises(SystemExit) as stop:
            run_command(lambda: run(cfg), "prog", errors=(RewardOutputError,))
        err = _error_line(capsys.readouterr().err)
        assert stop.value.code == 2
        assert err.startswith("prog: error: checking the reward before training (2 images of "
                              "32x32): reward 'test_call_counting' r")
        assert not (tmp_path / "run").exists()
        return
    out = run(cfg)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    printed = capsys.readouterr()
    warnings = (printed.out + printed.err).count("gives no learning signal")
    if outcome == "trains":
        assert [r["skipped"] for r in records] == [0, 0] and warnings == 0
        assert 0 < records[0]["reward_mean"] < 1
    else:
        assert warnings == 1 and records[0]["adv_abs_max"] == 0.0


def test_a_run_whose_rewards_are_all_nan_trains_nothing_and_fails_in_one_line(tiny_flux, tmp_path,
                                                                              capsys):
    """Finite on the start-up probe, NaN on every rollout: every iteration is skipped, and a run
    with no optimizer step is exit 2 with the cause (no summary, no final model)."""
    cfg = _config(tiny_flux, tmp_path, "nan", from_call=2, overrides={"run.max_steps": 2,
                                                                      "run.checkpoint_every": 1,
                                                                      "run.max_bad_steps": 5})
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: run(cfg), "prog", errors=(NothingTrained,))
    err = _error_line(capsys.readouterr().err)
    assert stop.value.code == 2
    assert ("no optimizer step in 2 iteration(s): the rewards were NaN/Inf in 2 iteration(s)"
            in err and "final_model is not exported" in err)
    out = tmp_path / "run"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["skipped"] for r in records] == [1, 1]
    assert [r["nonfinite"] for r in records] == ["reward", "reward"]
    assert latest_checkpoint(out) is None  # no good step: nothing saved as if it were
    assert not (out / "final_model").exists() and not (out / "summary.json").exists()


def test_a_reward_failing_mid_run_stops_in_one_line_naming_the_intact_checkpoint(
        tiny_flux, tmp_path, capsys):
    cfg = _config(tiny_flux, tmp_path, "raise", from_call=3, overrides={"run.max_steps": 3,
                                                                        "run.checkpoint_every": 1})
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: run(cfg), "prog", errors=(RewardOutputError,))
    err = _error_line(capsys.readouterr().err)
    kept = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert stop.value.code == 2
    assert "reward 'test_call_counting' raised RuntimeError while scoring 8 images" in err
    assert f"the run stopped at step 2, its last checkpoint {kept} is intact" in err
    assert load_checkpoint(kept)["run"]["step"] == 1


def test_diverged_run_names_a_checkpoint_that_exists_or_none(tiny_flux, tmp_path):
    cfg = _config(tiny_flux, tmp_path, "nan", from_call=2, overrides={"run.max_steps": 4,
                                                                      "run.checkpoint_every": 1,
                                                                      "run.max_bad_steps": 1})
    with pytest.raises(TrainingDiverged, match="no checkpoint was written yet"):
        run(cfg)
    cfg = _config(tiny_flux, tmp_path, "nan", from_call=3, overrides={
        "run.max_steps": 4, "run.checkpoint_every": 1, "run.max_bad_steps": 1,
        "run.output_dir": str(tmp_path / "run2")})
    with pytest.raises(TrainingDiverged) as err:
        run(cfg)
    named = str(err.value).split("its last checkpoint ")[1].split(" is intact")[0]
    assert named.endswith("step-00000001")
    assert load_checkpoint(named)["run"]["step"] == 1


def test_a_reward_calling_sys_exit_is_a_reward_error_not_the_end_of_the_run():
    def quits(images, prompts):
        raise SystemExit(0)

    with pytest.raises(RewardOutputError, match=r"^reward 'quits' raised SystemExit while "
                                                r"scoring 2 images"):
        call_reward("quits", quits, torch.rand(2, 3, 4, 4), ["a", "b"])


def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "fails_on_import.py").write_text("import os\nx = 1 / 0\n")
    (tmp_path / "lacks_a_dependency.py").write_text("import not_a_real_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardLoadError, match=r"importing module 'fails_on_import' failed at "
                                              r".*fails_on_import.py:2: ZeroDivisionError: "
                                              r"division by zero; fix the module") as err:
        get_reward("fails_on_import:r")
    assert "\n" not in str(err.value)
    with pytest.raises(RewardLoadError, match="No module named 'not_a_real_package_xyz'"):
        get_reward("lacks_a_dependency:r")
