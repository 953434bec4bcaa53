"""The chunk ablation: cells give the intended configs, the table and curves are written, a
finished run is not retrained, an interrupted run resumes to the uninterrupted result, and bad
input is a one-line error."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from trainer_utils import Brightness, registered_rewards

from chunk_grpo.algorithm.chunking import parse_chunk_spec
from chunk_grpo.analysis import ablate
from chunk_grpo.cli import ablate as ablate_cli
from chunk_grpo.cli.runner import run_cli
from chunk_grpo.config.errors import ConfigError, RunInterrupted
from chunk_grpo.train.metrics import read_metrics

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")


def tiny_base(model_dir, extra: dict | None = None):
    """Base flags of a tiny ablation: 5 steps, every one stochastic (4 trained transitions)."""
    values = {"model.name": str(model_dir), "reward.name": "test_brightness", "sampling.steps": 5,
              "sampling.group_size": 4, "sampling.prompts_per_step": 2,
              "optim.micro_batch_size": 4, "sampling.batch_size": 8,
              "model.mixed_precision": "no", "model.lora_rank": 0, "run.max_steps": 2,
              "sampling.eta": 0.7}
    values.update(extra or {})
    return ablate.base_values(None, values)


@pytest.fixture(scope="module")
def model(tiny_flux):
    return tiny_flux


@pytest.fixture(scope="module")
def finished(model, tmp_path_factory):
    """An uninterrupted two-cell, one-seed ablation of two iterations per run."""
    out = tmp_path_factory.mktemp("ablate") / "out"
    with registered_rewards(test_brightness=Brightness):
        table = ablate.run_ablation(out, ablate.parse_cells("chunk2,g2rpo"), [0],
                                    tiny_base(model), minutes=0, count=4, progress=False)
    return out, table


@pytest.mark.parametrize("num_steps, expected", [
    (5, {"step": (1, 1, 1, 1), "chunk2": (2, 2), "chunk4": (4,), "sequence": (4,)}),
    (10, {"step": (1,) * 9, "chunk2": (2, 2, 2, 2, 1), "chunk4": (4, 4, 1),
          "sequence": (9,)}),
])
def test_cells_give_the_intended_chunk_layouts(num_steps, expected):
    base = ablate.base_values(None, {"sampling.steps": num_steps})
    cfgs = {name: ablate.cell_config(base, cell, seed=1, minutes=2.0)
            for name, cell in ablate.CELLS.items()}
    for name, sizes in expected.items():
        layout = parse_chunk_spec(cfgs[name].chunks.spec, cfgs[name].num_trained,
                                  cfgs[name].chunks.size)
        assert layout.sizes == sizes, name
    for cfg in cfgs.values():  # the ablation's base: every step stochastic, the budget, the seed
        assert cfg.sampling.sde_window == 0 and cfg.run.max_minutes == 2.0 and cfg.run.seed == 1
        assert cfg.run.max_steps == ablate.TIME_LIMITED_MAX_STEPS and cfg.eval.hybrid_steps == 0
    assert cfgs["auto"].chunks.spec == "auto" and cfgs["auto"].chunks.size is None
    assert not cfgs["auto"].chunks.weighted and cfgs["auto"].chunks.fraction == 1.0
    assert cfgs["auto-ws"].chunks.spec == "auto" and cfgs["auto-ws"].chunks.weighted
    assert cfgs["auto-ws"].chunks.fraction == 0.5
    assert cfgs["g2rpo"].sampling.algorithm == "g2rpo"
    assert {cfg.sampling.algorithm for n, cfg in cfgs.items() if n != "g2rpo"} == {"chunk_grpo"}


def test_a_passed_flag_reaches_every_cell_and_a_too_big_chunk_names_its_cell():
    base = ablate.base_values(None, {"sampling.sde_window": 5, "optim.lr": 3e-4})
    cfg = ablate.cell_config(base, ablate.CELLS["chunk4"], seed=0, minutes=1.0)
    assert cfg.num_trained == 5 and cfg.optim.lr == 3e-4
    small = ablate.base_values(None, {"sampling.sde_window": 3})
    with pytest.raises(ConfigError, match="cell chunk4: chunk size 4 exceeds the 3 trained"):
        ablate.cell_config(small, ablate.CELLS["chunk4"], seed=0, minutes=1.0)


@pytest.mark.parametrize("argv, message", [
    (["--cells", "step,chunk3"], "unknown cell 'chunk3'; choose from step, chunk2"),
    (["--seeds", ","], "--seeds is empty"),
    (["--seeds", "0,x"], "--seeds must be comma-separated integers"),
    (["--cells", "chunk4", "--sampling.sde_window", "2"],
     "cell chunk4: chunk size 4 exceeds the 2"),
    (["--chunks.spec", "2,2"], "--chunks.spec is set by the ablation; use --cells"),
    (["--run.seed", "3"], "--run.seed is set by the ablation; use --seeds"),
    (["--minutes", "0"], "--minutes 0 needs --run.max_steps"),
    (["--resume", "x"], "rerun the same command"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: ablate_cli.main(["--out", str(tmp_path / "out"), *argv]),
                "chunk_grpo.ablate")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m chunk_grpo.ablate: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out" / "cells").exists()  # refused before anything ran


@pytest.mark.slow  # its fixture runs a whole small ablation (~10 s)
def test_table_curves_and_results(finished):
    out, table = finished
    assert (out / "table.md").read_text() == table
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| cell | chunks | held-out gain (95% CI) | colour | shape | count "
                              "| position | s | iterations |")
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| base (no training)", "| chunk2",
                                                      "| g2rpo"]
    assert "Equal compute: 2 iterations per run" in table
    assert "every step stochastic (sde_window 0" in table
    chunk2 = json.loads((out / "cells" / "chunk2-s0" / "result.json").read_text())
    assert chunk2["iterations"] == 2 and chunk2["chunk_layout"] == [2, 2]
    assert "[2,2]" in rows[2] and rows[2].endswith("| 2 |")
    # The gain is the paired difference with the cached base evaluation of the same images.
    base = torch.load(out / "base_eval.pt")[str(1000)]
    assert len(chunk2["eval"]["rewards"]) == 4
    assert chunk2["gain"] == pytest.approx(float(np.mean(chunk2["eval"]["rewards"])
                                                 - base.double().mean()), abs=1e-6)
    assert f"{chunk2['gain']:+.3f} (1 seed: no CI)" in rows[2]
    assert set(chunk2["eval"]["shapes"]) >= {"colour_acc", "shape_acc", "count_acc"}
    image = Image.open(out / "curves.png")
    assert image.size[0] == 720 and image.size[1] > 420  # drawn, with a two-entry legend


def test_a_finished_run_is_not_retrained(finished, model, monkeypatch, capsys):
    out, table = finished
    mtime = (out / "cells" / "chunk2-s0" / "result.json").stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(ablate, "train_run", no_training)
    monkeypatch.setattr(ablate, "load_policy", no_training)  # nor evaluated, nor the base
    # The same ablation from the command line: every flag a string, as typed.
    flags = [f"--{k}={v}" for k, v in tiny_base(model).items()]
    again = ablate_cli.main(["--out", str(out), "--cells", "chunk2,g2rpo", "--seeds", "0",
                         "--minutes", "0", "--eval-images", "4", *flags])
    assert again == table
    assert table in capsys.readouterr().out
    assert (out / "cells" / "chunk2-s0" / "result.json").stat().st_mtime_ns == mtime


def test_other_settings_in_the_same_out_are_refused(finished, model):
    out, _ = finished
    with pytest.raises(ConfigError, match="other settings \\(eval_images: 4 there, 8 now\\)"):
        ablate.run_ablation(out, ablate.parse_cells("chunk2"), [0], tiny_base(model),
                            minutes=0, count=8, progress=False)


class Stop(KeyboardInterrupt):
    pass


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(finished, model, tmp_path):
    reference = json.loads((finished[0] / "cells" / "chunk2-s0" / "result.json").read_text())
    out, cells = tmp_path / "out", ablate.parse_cells("chunk2")

    def stop_after_1(step, metrics):
        if step == 1:
            raise Stop

    # The trainer turns Ctrl-C into RunInterrupted (naming the checkpoint to resume from).
    with pytest.raises(RunInterrupted):
        ablate.run_ablation(out, cells, [0], tiny_base(model), minutes=0, count=4,
                            on_step_end=stop_after_1, progress=False)
    run_dir = out / "cells" / "chunk2-s0"
    assert not (run_dir / "result.json").exists()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]
    ablate.run_ablation(out, cells, [0], tiny_base(model), minutes=0, count=4, progress=False)
    resumed = json.loads((run_dir / "result.json").read_text())
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert resumed["iterations"] == reference["iterations"] == 2
    assert resumed["eval"]["rewards"] == reference["eval"]["rewards"]
    assert resumed["gain"] == reference["gain"]


def test_a_resumed_run_gets_only_the_rest_of_its_time(model, tmp_path):
    """Stopped after one iteration that (say) used the whole budget: the resumed run trains one
    more iteration and stops, instead of a fresh budget."""
    cfg = ablate.cell_config(tiny_base(model, {"run.max_steps": 50}), ablate.CELLS["chunk2"],
                             seed=0,
                             minutes=10.0)
    run_dir = tmp_path / "run"

    def stop_after_1(step, metrics):
        if step == 1:
            raise Stop

    with pytest.raises(RunInterrupted):
        ablate.train_resumably(cfg, run_dir, stop_after_1)
    (run_dir / "timing.json").write_text(json.dumps({"elapsed": {"1": 600.0}}))
    trained = ablate.train_resumably(cfg, run_dir)
    assert trained["iterations"] == 2 and trained["seconds"] > 600.0
    # Stopped while exporting (after its last iteration): re-exported, not trained further.
    final = run_dir / "final_model"
    for path in sorted(final.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    final.rmdir()
    again = ablate.train_resumably(cfg, run_dir)
    assert again["iterations"] == 2 and (final / "model_index.json").is_file()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


def test_quick_shortens_the_budget_unless_told_otherwise():
    quick = ablate.parse_ablation_args(["--quick"])
    assert quick.minutes == ablate.QUICK["minutes"] and quick.eval_images == 16
    assert quick.base["sampling.prompts_per_step"] == 2 and quick.base["sampling.sde_window"] == 0
    assert [c.name for c in quick.cells] == list(ablate.CELLS) and quick.seeds == [0, 1, 2]
    told = ablate.parse_ablation_args(["--quick", "--minutes", "2", "--sampling.prompts_per_step",
                                       "4", "--eval-images", "8", "--sampling.sde_window", "5"])
    assert (told.minutes, told.eval_images) == (2.0, 8)
    assert told.base["sampling.prompts_per_step"] == 4 and told.base["sampling.sde_window"] == 5
    full = ablate.parse_ablation_args([])
    assert (full.minutes, full.eval_images) == (10.0, 64)
    assert "sampling.prompts_per_step" not in full.base
