"""End to end: the CLI trains, saves its config, profile, metrics, grids and a diffusers model
that `python -m chunk_grpo.evaluate --model.name` accepts; faults stop the run cleanly; LoRA."""

import json

import pytest
import torch
from trainer_utils import tiny_config, without_times

from chunk_grpo.cli import evaluate as evaluate_cli
from chunk_grpo.cli.runner import run_command
from chunk_grpo.cli.train import main
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import load_saved_config
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.loading import ModelLoadError
from chunk_grpo.runtime.distributed import init_distributed
from chunk_grpo.train.checkpoint import latest_checkpoint, load_checkpoint
from chunk_grpo.train.loop import TrainingDiverged, run
from chunk_grpo.train.metrics import read_metrics
from chunk_grpo.train.run_eval import evaluate
from chunk_grpo.train.setup import build_trainer


class NanAfterFirst:
    """Finite rewards on the first two calls (the start-up probe, then step 1), NaN afterwards."""

    calls = 0

    def __call__(self, images, prompts):
        NanAfterFirst.calls += 1
        r = images.float().mean(dim=(1, 2, 3))
        return r if NanAfterFirst.calls <= 2 else r * float("nan")


@pytest.fixture(autouse=True)
def toy_rewards(register_test_reward, brightness_reward):
    """This module's toy rewards, registered for each of its tests."""
    register_test_reward("test_nan_after_first", NanAfterFirst)
    register_test_reward("test_falling_guard", FallingGuard)


def test_cli_two_steps_auto_chunks_and_export(tiny_flux, tmp_path):
    model = tiny_flux
    out = tmp_path / "run"
    main(["--model.name", str(model), "--reward.name", "test_brightness", "--run.output_dir",
          str(out), "--sampling.steps", "6", "--sampling.group_size", "4",
          "--sampling.prompts_per_step", "2", "--optim.micro_batch_size", "4", "--chunks.spec",
          "auto", "--chunks.weighted", "true", "--sampling.sde_window", "0", "--chunks.fraction",
          "0.5", "--run.max_steps", "2", "--eval.images", "4", "--eval.final_images", "6",
          "--eval.hybrid_steps", "2", "--run.image_grid_every", "1", "--run.progress", "false",
          "--optim.lr", "1e-3"])
    saved = load_saved_config(out / "config.yaml")
    assert saved.get("sampling.steps") == 6 and saved.get("chunks.spec") == "auto"
    profile = json.loads((out / "profile.json").read_text())
    assert len(profile["l1rel"]) == 6 and sum(profile["chunks"]) == 5  # T-1 trained steps
    assert (out / "profile.png").stat().st_size > 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward_mean", "reward_std", "adv_std", "loss", "grad_norm", "clip_frac",
                "approx_kl", "time/rollout", "time/reward", "time/train"):
        assert key in records[0], key
    assert any(k.startswith("chunk") and k.endswith("/ratio_mean") for k in records[0])
    # the guard (auto: the shapes checks on shapes prompts) on every iteration's rollouts
    assert all(0.0 <= r["guard/shapes_mean"] <= 1.0 and "time/guard" in r for r in records)
    assert "eval/reward_ci95" in records[-1] and "eval_hybrid/reward_mean" in records[-1]
    assert "eval/gain_vs_base" in records[-1] and "eval_hybrid/gain_ci95" in records[-1]
    assert list((out / "tensorboard").iterdir())
    assert (out / "images" / "rollout-000000.png").exists()
    # The closing summary: the final evaluation (6 images) paired against the base's.
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"eval", "eval_hybrid", "chunks", "stopped"}
    assert summary["eval"]["n"] == 6 and summary["stopped"] is None
    final = records[-1]
    # the guard on the same images, paired, and the verdict of both gains
    guard = summary["eval"]["guard"]
    assert guard["name"] == "shapes" and guard["n"] == 6 and summary["eval"]["verdict"]
    assert guard["gain"] == pytest.approx(final["eval/guard/shapes_gain_vs_base"], abs=1e-9)
    assert guard["after"] == pytest.approx(final["eval/guard/shapes_mean"], abs=1e-9)
    assert guard["after"] == pytest.approx(summary["eval"]["attributes_after"]["fidelity_score"])
    # chunk_fraction 0.5: half the chunks each iteration, counted per chunk
    chunks = summary["chunks"]
    assert chunks["sizes"] == profile["chunks"] and chunks["weighted"] is True
    assert chunks["iterations"] == 2 and chunks["per_iteration"] == max(
        1, round(0.5 * len(profile["chunks"])))
    assert sum(chunks["trained"]) == 2 * chunks["per_iteration"]
    assert chunks["trained"] == [sum(str(j) in r["chunks_trained"].split(",") for r in records)
                                 for j in range(len(profile["chunks"]))]
    assert summary["eval"]["gain"] == pytest.approx(final["eval/gain_vs_base"], abs=1e-9)
    assert summary["eval"]["after"] == pytest.approx(final["eval/reward_mean"], abs=1e-9)
    text = (out / "summary.txt").read_text()
    assert "paired gain" in text and str(out / "final_model") in text and "--resume" in text
    # Held-out shapes prompts: the shapes checks stand beside the trained (brightness) reward.
    assert "shapes checks: colour" in text and "colour_acc" in summary["eval"]["attributes_after"]
    assert "guard     shapes before" in text and f"verdict   {summary['eval']['verdict']}" in text
    assert "times trained over 2 iterations: " in text
    assert (out / "images" / "before_after.png").exists()
    state = load_checkpoint(out)
    assert state["run"]["chunk_layout"] == profile["chunks"]

    # The exported model is a diffusers directory with the sampling defaults of the base.
    exported = FluxPolicy.from_pretrained(out / "final_model")
    assert (exported.height, exported.max_sequence_length) == (32, 8)
    result = evaluate_cli.main(["--model.name", str(out / "final_model"), "--reward.name",
                                "test_brightness", "--max-prompts", "4", "--out",
                                str(tmp_path / "eval"), "--hybrid-base", str(model),
                                "--eval.hybrid_steps", "2"])
    assert result.n == 4 and 0.0 <= result.reward_mean <= 1.0


@pytest.mark.slow  # two CLI processes (train, then resume): ~50 s on a loaded 2-core CPU
def test_cli_trains_on_a_users_reward_module_and_resumes_with_it(tiny_flux, tmp_path, monkeypatch):
    (tmp_path / "user_rewards_e2e.py").write_text(
        "from chunk_grpo.rewards import register_reward\n\n\n"
        "@register_reward('test_user_darkness')\n"
        "def make():\n"
        "    return lambda images, prompts: 1.0 - images.float().mean(dim=(1, 2, 3))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    common = ["--model.name", str(tiny_flux), "--run.output_dir", str(out), "--sampling.steps",
              "4", "--sampling.group_size", "2", "--sampling.prompts_per_step", "2",
              "--optim.micro_batch_size", "4", "--chunks.spec", "3", "--sampling.sde_window", "3",
              "--eval.every", "0", "--run.image_grid_every", "0", "--run.progress", "false",
              "--run.checkpoint_every", "1", "--eval.hybrid_steps", "2"]
    main([*common, "--reward.name", "user_rewards_e2e:test_user_darkness", "--run.max_steps", "1"])
    assert load_saved_config(out / "config.yaml").get("reward.name") == (
        "user_rewards_e2e:test_user_darkness")
    main(["--resume", str(out), "--run.max_steps", "2"])
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and 0.0 < records[1]["reward_mean"] < 1.0


def test_hybrid_steps_beyond_the_evaluation_steps_fail_before_training(tiny_flux, tmp_path):
    # The tiny model samples evaluations in 5 steps; the default eval_hybrid_steps is 8.
    cfg = tiny_config(tiny_flux, tmp_path / "run", {"eval.hybrid_steps": 8})
    with pytest.raises(ConfigError, match="eval.hybrid_steps=8 exceeds the 5 steps"):
        run(cfg)
    assert not (tmp_path / "run").exists()


def test_a_misspelt_reward_or_missing_model_fails_first_and_leaves_no_run_directory(
        tiny_flux, tmp_path, capsys):
    cfg = tiny_config(tiny_flux, tmp_path / "run", {"reward.name": "test_brightnes"})
    capsys.readouterr()  # the tiny model's save progress bars
    with pytest.raises(ConfigError, match="unknown reward 'test_brightnes' \\(did you mean "
                                          "'test_brightness'\\?\\)"):
        run(cfg)
    assert not (tmp_path / "run").exists()
    odd = tiny_config(tiny_flux, tmp_path / "run", {"model.height": 63})
    with pytest.raises(ConfigError, match="height and width must be multiples of 8, got 63x32"):
        run(odd)
    assert not (tmp_path / "run").exists()
    capsys.readouterr()  # its model's loading progress bars
    # On the command line: one line on stderr and exit status 2, as for argparse's errors.
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: run(cfg), "python -m chunk_grpo.train")
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(
        "python -m chunk_grpo.train: error: reward: unknown reward 'test_brightnes'")
    # A model that cannot be loaded, when the command lists its error type: the same one line.
    missing = tiny_config(tmp_path, tmp_path / "run2", {"model.name": str(tmp_path / "no-model")})
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: run(missing), "prog", errors=(ModelLoadError,))
    assert stop.value.code == 2 and "prog: error: " in capsys.readouterr().err
    with pytest.raises(ModelLoadError):  # not listed: raised as it is
        run_command(lambda: run(missing), "prog")
    assert not (tmp_path / "run2").exists()  # the model is loaded before the run directory


def test_nonfinite_rewards_skip_steps_then_stop(tiny_flux, tmp_path):
    NanAfterFirst.calls = 0
    model = tiny_flux
    cfg = tiny_config(model, tmp_path / "run", {"reward.name": "test_nan_after_first",
                                                "run.max_steps": 6,
                                                "run.checkpoint_every": 1,
                                                "run.max_bad_steps": 2})
    with pytest.raises(TrainingDiverged, match="2 iterations in a row had NaN/Inf"):
        run(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["skipped"] for r in records] == [0, 1, 1]
    assert records[1]["nonfinite"] == "reward"
    assert latest_checkpoint(tmp_path / "run").name == "step-00000001"  # the last good one


def test_lora_with_reference_kl_and_merged_export(tiny_flux, tmp_path):
    model = tiny_flux
    cfg = tiny_config(model, tmp_path / "run", {"run.max_steps": 1, "model.lora_rank": 4,
                                                "loss.kl_coef": 0.1,
                                                "loss.kl_ref": "reference",
                                                "optim.lr": 1e-2,
                                                "optim.name": "adamw8bit"})
    out = run(cfg)
    records = read_metrics(out / "metrics.jsonl")
    assert "ref_kl" in records[0] and records[0]["optimizer_steps"] == 1
    state = load_checkpoint(out)
    assert state["model"] and all("lora" in name for name in state["model"])
    # The merged export computes what base + adapters computed.
    trained = FluxPolicy.from_pretrained(model)
    from chunk_grpo.models.policy_setup import load_trainable_state_dict, prepare_transformer

    prepare_transformer(trained.transformer, lora_rank=4, lora_alpha=None,
                        lora_targets=cfg.model.lora_targets, gradient_checkpointing=False,
                        attention_backend="native")
    load_trainable_state_dict(trained.transformer, state["model"])
    merged = FluxPolicy.from_pretrained(out / "final_model")
    base = FluxPolicy.from_pretrained(model)
    x = trained.initial_noise(2, torch.Generator().manual_seed(0))
    emb = trained.encode_prompts(["a red circle", "two blue squares"])
    s = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        v_lora = trained.velocity(x, s, emb)
        v_merged = merged.velocity(x, s, emb)
        v_base = base.velocity(x, s, emb)
    torch.testing.assert_close(v_merged, v_lora, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(v_base, v_lora, atol=1e-5)  # the adapters did learn something


def test_eval_gain_vs_base_is_exactly_zero_before_training(tiny_flux, tmp_path):
    # LoRA starts with B = 0: the policy samples the base's images bit for bit.
    cfg = tiny_config(tiny_flux, tmp_path / "run", {"model.lora_rank": 4, "eval.hybrid_steps": 2,
                                                    "eval.images": 3})
    tr = build_trainer(cfg, tmp_path / "run", init_distributed("cpu"))
    out = evaluate(tr, 0)
    assert out["eval/gain_vs_base"] == 0.0 and out["eval_hybrid/gain_vs_base"] == 0.0
    assert tr.base_evals[3].rewards.shape == (3,)
    with torch.no_grad():  # move the policy: the gain is now measured against the cached base
        for p in tr.params:
            p.add_(0.5)
    moved = evaluate(tr, 1)
    assert moved["eval/gain_vs_base"] != 0.0
    # fp32 rewards: the mean of differences and the difference of means agree to ~1e-8.
    assert moved["eval/gain_vs_base"] == pytest.approx(
        moved["eval/reward_mean"] - float(tr.base_evals[3].rewards.mean()), abs=1e-6)


class FallingGuard:
    """A guard that scores brightness, minus 0.5 once `falling` is set: whatever the model does,
    the evaluations after that see it fall by 0.5 on every image against the base's cached
    scores."""

    falling = False

    def __call__(self, images, prompts):
        return images.float().mean(dim=(1, 2, 3)) - (0.5 if FallingGuard.falling else 0.0)




def test_a_guard_that_falls_beyond_eval_guard_stop_ends_the_run_cleanly(tiny_flux, tmp_path,
                                                                        capsys):
    FallingGuard.falling = False

    def fall_after_step_1(step, metrics):
        FallingGuard.falling = FallingGuard.falling or step == 1

    # The base is evaluated at step 1 (before the fall) and cached; at step 2 the policy's guard
    # is 0.5 below it on all 4 images: the CI (width 0) lies below -0.1, so the run stops.
    cfg = tiny_config(tiny_flux, tmp_path / "run", {"run.max_steps": 6, "eval.every": 1,
                                                    "eval.hybrid_steps": 2,
                                                    "eval.images": 4,
                                                    "eval.final_images": 4,
                                                    **{"eval.guard_reward": "test_falling_guard",
                                                       "eval.guard_stop": 0.1}})
    try:
        out = run(cfg, on_step_end=fall_after_step_1)
    finally:
        FallingGuard.falling = False
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["eval/guard/test_falling_guard_gain_vs_base"]) < 0.05  # no stop yet
    assert records[1]["eval/guard/test_falling_guard_gain_vs_base"] == pytest.approx(-0.5,
                                                                                    abs=0.05)
    rollouts = [r["guard/test_falling_guard_mean"] for r in records]
    assert rollouts[1] < rollouts[0] - 0.4  # the rollouts saw the fall too
    printed = capsys.readouterr()
    assert "[chunk-grpo] stopping early: guard test_falling_guard fell 0." in (
        printed.out + printed.err)
    # cleanly: a checkpoint at the stop, the final evaluation, the summary and the export
    assert latest_checkpoint(out).name == "step-00000002"
    assert json.loads((out / "finished.json").read_text()) == {
        "step": 2, "summary": True, "final_model": True}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"].startswith("guard test_falling_guard fell 0.")
    assert "eval.guard_stop" in summary["stopped"]
    assert summary["eval"]["guard"]["gain"] == pytest.approx(-0.5, abs=0.05)
    assert summary["eval"]["verdict"].split(": ")[0].endswith("test_falling_guard down")
    text = (out / "summary.txt").read_text()
    assert "stopped   guard test_falling_guard fell 0." in text
    assert (out / "final_model" / "model_index.json").is_file()


def test_the_guard_changes_nothing_the_run_trains(tiny_flux, tmp_path):
    """Scoring a guard (here the shapes checks) on the rollouts draws no random number the
    training uses: every trained metric is the same, bit for bit, with the guard on or off."""
    model = tiny_flux
    runs = {}
    for guard in ("none", "shapes"):
        out = run(tiny_config(model, tmp_path / guard, {"run.max_steps": 3,
                                                        **{"eval.guard_reward": guard}}))
        runs[guard] = read_metrics(out / "metrics.jsonl")
    assert not any(k.startswith("guard/") for r in runs["none"] for k in r)
    assert all("guard/shapes_mean" in r for r in runs["shapes"])
    trained = [{k: v for k, v in r.items() if not k.startswith(("guard/", "eval/guard/"))
                and k not in ("eval/fidelity_score", "eval/colour_acc", "eval/shape_acc",
                              "eval/size_acc", "eval/count_acc", "eval/spatial_acc",
                              "eval/exact")} for r in without_times(runs["shapes"])]
    assert trained == without_times(runs["none"])


def test_a_guard_that_cannot_score_the_training_prompts(tiny_flux, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a purple dog\na moon over a lake\n")
    model = tiny_flux
    # named in eval.guard_reward: an error before the run directory exists
    named = tiny_config(model, tmp_path / "named", {"data.train_prompts": str(prompts),
                                                    "eval.guard_reward": "shapes"})
    with pytest.raises(ConfigError, match=r"^eval.guard_reward 'shapes' cannot score "
                                          r"data.train_prompts: .*'a purple dog'.*; choose "
                                          r"another eval.guard_reward, or none$"):
        run(named)
    assert not (tmp_path / "named").exists()
    # auto (the shapes checks for the shapes: evaluation prompts): scored at evaluations only
    capsys.readouterr()
    out = run(tiny_config(model, tmp_path / "auto", {"data.train_prompts": str(prompts),
                                                     "run.max_steps": 1,
                                                     "eval.hybrid_steps": 2}))
    assert "it is scored at the evaluations only" in capsys.readouterr().out
    record = read_metrics(out / "metrics.jsonl")[0]
    assert not any(k.startswith("guard/") for k in record) and "eval/guard/shapes_mean" in record
    assert json.loads((out / "summary.json").read_text())["eval"]["guard"]["name"] == "shapes"
