"""`evaluate_clip` names its model, prompts and seed as the training config does; the command
configs of `chunk_grpo.config.commands` check themselves like the training sections."""

import json

import pytest

from chunk_grpo.cli.evaluate_clip import evaluate_clip_parser
from chunk_grpo.cli.evaluate_clip import main as evaluate_clip_main
from chunk_grpo.config.commands import EvaluateConfig, RewardServerConfig
from chunk_grpo.config.decoding import decode_config
from chunk_grpo.config.errors import ConfigError


def test_evaluate_clip_settings_parse_under_the_configs_dotted_names():
    own, cfg = evaluate_clip_parser().parse_config([
        "--model.name", "M", "--data.eval_prompts", "shapes:train", "--run.seed", "4",
        "--clip", "C", "--renders", "8", "--group", "4", "--num-prompts", "0",
        "--images-per-prompt", "2"])
    assert (cfg.model.name, cfg.data.eval_prompts, cfg.run.seed) == ("M", "shapes:train", 4)
    assert (own["clip"], own["renders"], own["group"], own["num_prompts"],
            own["images_per_prompt"]) == ("C", 8, 4, 0, 2)
    _, default = evaluate_clip_parser().parse_config([])
    assert (default.model.name, default.data.eval_prompts, default.run.seed) == (
        "embedded", "shapes:heldout", 0)


@pytest.mark.parametrize("args, message", [
    (["--run.seed", "x"], "run.seed must be an int, got 'x'"),
    (["--model", "M"], "--model is a section; set its keys, e.g. --model.name VALUE"),
    (["--prompts", "p.txt"], "did you mean 'data.eval_prompts'?"),
    (["--seed", "1"], "did you mean 'run.seed'?"),
    (["--sampling.steps", "4"], "unknown config key 'sampling.steps'"),
    (["--group", "1"], "--group must be >= 2 and --renders at least --group"),
])
def test_evaluate_clip_bad_settings_are_one_line_errors(args, message):
    with pytest.raises(ConfigError) as err:
        evaluate_clip_main(args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_evaluate_clip_samples_its_prompts_with_its_seed(tmp_path):
    """The generated half: model.name samples data.eval_prompts from run.seed, as
    `evaluate_policy` does with the same settings."""
    from chunk_grpo.data.prompts import load_prompts
    from chunk_grpo.evaluate.evaluation import evaluate_policy
    from chunk_grpo.models import EMBEDDED_MODEL, FluxPolicy

    out = tmp_path / "clip.json"
    metrics = evaluate_clip_main(["--renders", "4", "--group", "2", "--num-prompts", "3",
                                  "--data.eval_prompts", "shapes:train", "--run.seed", "2",
                                  "--out", str(out)])
    assert json.loads(out.read_text()) == pytest.approx(metrics, nan_ok=True)
    assert metrics["generated_images"] == 3
    direct = evaluate_policy(FluxPolicy.from_pretrained(EMBEDDED_MODEL),
                             load_prompts("shapes:train")[:3], reward="shapes", seed=2)
    assert metrics["shapes_reward_mean"] == pytest.approx(direct.reward_mean, abs=1e-6)


def test_command_sections_check_themselves():
    with pytest.raises(ConfigError, match="sampling.cfg_scale must be >= 0, got -1"):
        decode_config(EvaluateConfig, {"sampling": {"cfg_scale": -1}}, "a test")
    with pytest.raises(ConfigError, match="sampling.shift must be > 0"):
        decode_config(EvaluateConfig, {"sampling.shift": 0}, "a test")
    with pytest.raises(ConfigError, match="eval.hybrid_steps must be >= 0"):
        decode_config(EvaluateConfig, {"eval.hybrid_steps": -1}, "a test")
    with pytest.raises(ConfigError, match="model.width must be >= 16 pixels"):
        decode_config(EvaluateConfig, {"model.width": 4}, "a test")
    with pytest.raises(ConfigError, match="unknown config key 'sampling.group_size' in a test"):
        decode_config(EvaluateConfig, {"sampling.group_size": 4}, "a test")
    mix = decode_config(EvaluateConfig, {"reward": {"name": {"shapes": 1.0, "jpeg": 0.5}}}, "y")
    assert mix.reward.name == "shapes=1.0,jpeg=0.5"  # the YAML mapping shorthand of a mix
    served = decode_config(RewardServerConfig, {"reward.device": "cuda:0"}, "a test")
    assert served.reward.name == "" and served.reward.device == "cuda:0"  # name: required later
