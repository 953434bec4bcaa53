"""The logging backends of `run.report_to`: JSONL, TensorBoard (scalars, image grids, the
summary) and Weights & Biases, offline (WANDB_MODE=offline: no network), with the same scalars
as the JSONL log, the image grids and the summary; a missing wandb is a one-line error."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.train.metrics import MetricsLogger, read_metrics


def test_tensorboard_gets_the_scalars_grids_and_summary_and_jsonl_is_optional(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, report_to=["tensorboard"])
    logger.log(1, {"reward_mean": torch.tensor(0.25), "loss": float("nan"), "note": "x"})
    path = logger.image_grid(1, "eval", torch.rand(2, 3, 8, 8), ["0.1  a", "0.2  b"])
    logger.summary("chunk-grpo run finished\nbefore 0.1 -> after 0.2", {"final/eval/gain": 0.1})
    logger.close()
    assert path == tmp_path / "images" / "eval-000001.png" and path.is_file()
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl not asked for
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert tags["scalars"] == ["reward_mean"]  # the finite numbers only, as before
    assert events.Scalars("reward_mean")[0].value == pytest.approx(0.25)
    assert tags["images"] == ["images/eval"]
    image = events.Images("images/eval")[0]
    assert (image.step, image.width, image.height) == (1, *Image.open(path).size)
    assert "summary/text_summary" in tags["tensors"]


def test_report_to_is_checked_and_a_missing_wandb_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^run.report_to: 'mlflow' is not a logging backend; "
                                          r"give any of tensorboard, jsonl, wandb$"):
        build_config(None, {"run.report_to": "jsonl,mlflow"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^run.report_to: wandb is not installed; pip install "
                                          r"'chunk-grpo\[wandb\]' \(or wandb>=0.17\), or drop "
                                          r"wandb from run.report_to$"):
        build_config(None, {"run.report_to": "wandb"})
    assert build_config(None, {}).run.report_to == ["tensorboard", "jsonl"]


# ----------------------------------------------------------------------------- wandb, offline

def wandb_records(run_dir: Path) -> list:
    """The records of the offline wandb run in ``run_dir`` (its one run-<id>.wandb file: the
    LevelDB log format, 32 KiB blocks of chunks with a 7-byte header, after a 7-byte file
    header ":W&B", 0xBEE1, version), as wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, parts, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts = data[pos + 7:pos + 7 + length] if kind in (1, 2) else parts + data[
            pos + 7:pos + 7 + length]  # 1 full, 2 first, 3 middle, 4 last
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def history_rows(records: list) -> list[dict]:
    return [{"/".join(item.nested_key) or item.key: json.loads(item.value_json)
             for item in r.history.item} for r in records if r.WhichOneof("record_type") ==
            "history"]


@pytest.mark.slow  # a 2-iteration training command with wandb: ~40 s
def test_offline_wandb_run_has_the_scalars_images_and_summary(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, "-m", "chunk_grpo.train", "--run.max_steps", "2", "--run.report_to",
         "wandb,jsonl", "--run.output_dir", str(out), "--run.name", "tiny-offline",
         "--run.wandb_project", "chunk-grpo-tests", "--run.progress", "false",
         "--run.image_grid_every", "1", "--sampling.prompts_per_step", "2",
         "--sampling.group_size", "2", "--chunks.profile_prompts", "2", "--eval.images", "2",
         "--eval.final_images", "2", "--eval.hybrid_steps", "2"],
        env=env, check=True, capture_output=True, timeout=600)
    records = wandb_records(out)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("chunk-grpo-tests", "tiny-offline")
    assert (out / "wandb-run-id").read_text().strip() == run.run_id
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["run"]["report_to"] == ["wandb", "jsonl"] and config["sampling"]["group_size"]

    # the same scalars as metrics.jsonl, against the run's step
    rows = history_rows(records)
    logged = {row["step"]: row for row in rows if "reward_mean" in row}
    jsonl = read_metrics(out / "metrics.jsonl")
    assert sorted(logged) == [r["step"] for r in jsonl] == [1, 2]
    for record in jsonl:
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        assert "eval/reward_mean" in numbers or record["step"] == 1
        for key, value in numbers.items():
            assert logged[record["step"]][key] == pytest.approx(value, rel=1e-6), key

    # the captioned grids: rollouts, evaluations, before/after, their PNGs in the run's files
    images = {key.split("/")[1]: row for row in rows for key in row
              if key.startswith("images/") and key.endswith("/_type")}
    assert {"rollout", "eval", "eval_hybrid", "before_after"} <= set(images)
    media = images["eval"]["images/eval/path"]
    assert next(out.glob("wandb/offline-run-*/files")).joinpath(media).stat().st_size > 0
    assert images["eval"]["images/eval/caption"] == "eval, step 2"

    # the summary: its text and numbers
    summary = {u.key or "/".join(u.nested_key): json.loads(u.value_json)
               for r in records if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update}
    assert summary["summary"].strip() == (out / "summary.txt").read_text().strip()
    saved = json.loads((out / "summary.json").read_text())
    assert summary["final/eval/gain"] == pytest.approx(saved["eval"]["gain"])


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    ids = []
    for step in (1, 2):  # the first run, then its resumption in the same directory
        logger = MetricsLogger(tmp_path, report_to=["wandb"], name="resumed")
        logger.log(step, {"reward_mean": 0.5 * step})
        ids.append(logger.backends[0].run.id)
        logger.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb-run-id").read_text().strip()
