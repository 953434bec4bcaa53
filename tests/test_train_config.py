"""The training config: presets, command-line overrides, and clear errors for bad input."""

from pathlib import Path

import pytest
import yaml

from chunk_grpo.config import ConfigError, TrainConfig, build_config, parse_args, save_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_default_preset_is_the_dataclass_default():
    assert build_config(CONFIGS / "default.yaml") == TrainConfig().validate()


def test_flux_preset_has_the_papers_settings():
    cfg = build_config(CONFIGS / "flux_dev_hpsv3.yaml")
    assert (cfg.num_steps, cfg.shift, cfg.eta, cfg.group_size) == (17, 3.0, 0.7, 12)
    assert cfg.chunks == "2,3,4,7" and cfg.chunk_fraction == 0.5
    assert (cfg.lr, cfg.clip_low, cfg.clip_high, cfg.max_grad_norm) == (1e-5, 5e-5, 5e-5, 0.01)
    assert (cfg.height, cfg.width, cfg.max_steps) == (720, 720, 150)
    assert cfg.mixed_precision == "bf16" and cfg.gradient_checkpointing


def test_cli_overrides_yaml_and_types(tmp_path):
    path, overrides, resume = parse_args(
        ["--config", "x.yaml", "--group-size", "6", "--clip_low", "1e-3", "--chunks", "7,8",
         "--num-steps", "16", "--sde-window", "0", "--cfg-scale", "none", "--shared-noise", "true",
         "--lora-targets", "to_q,to_v"])
    assert path == "x.yaml" and resume is None
    yml = tmp_path / "x.yaml"
    yml.write_text(yaml.safe_dump({"group_size": 3, "lr": 0.5, "chunks": [2, 3, 4, 6],
                                  "num_steps": 16, "sde_window": 0}))
    cfg = build_config(yml, overrides)
    assert cfg.group_size == 6 and cfg.lr == 0.5 and cfg.clip_low == 1e-3
    assert cfg.chunks == "7,8" and cfg.cfg_scale is None and cfg.shared_noise is True
    assert cfg.lora_targets == ["to_q", "to_v"]
    assert build_config(yml).chunks == "2,3,4,6"  # a YAML list becomes the spec string


def test_saved_config_round_trips(tmp_path):
    cfg = build_config(None, {"group_size": 5, "chunk_size": 3, "adv_clip_max": None})
    save_config(cfg, tmp_path / "config.yaml")
    assert build_config(tmp_path / "config.yaml") == cfg


def test_unknown_keys_are_errors(tmp_path):
    yml = tmp_path / "bad.yaml"
    yml.write_text("group_sise: 4\n")
    with pytest.raises(ConfigError, match="unknown config key 'group_sise'.*'group_size'"):
        build_config(yml)
    with pytest.raises(ConfigError, match="unknown config key 'learning_rat'"):
        parse_args(["--learning-rat", "3"])
    with pytest.raises(ConfigError, match="either --config or --resume"):
        parse_args(["--config", "a.yaml", "--resume", "runs/x"])
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(tmp_path / "missing.yaml")


def test_sde_window_sets_the_trained_transitions():
    cfg = build_config(None, {"num_steps": 10, "sde_window": 4, "chunks": "1,3"})
    assert cfg.num_trained == 4
    assert build_config(None, {"num_steps": 10, "sde_window": 0}).num_trained == 9


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"group_size": "four"}, "group_size expects int"),
        ({"group_size": 2.5}, "group_size expects int"),
        ({"lr": "fast"}, "lr expects float"),
        ({"shared_noise": "maybe"}, "shared_noise expects bool"),
        ({"group_size": None}, "group_size cannot be null"),
        ({"sde_kind": "euler"}, "sde_kind must be one of flow, dance, cps, cps_mse"),
        ({"adv_norm": "batch"}, "adv_norm must be one of"),
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"num_steps": 1}, "num_steps must be >= 2"),
        ({"chunk_fraction": 0.0}, "chunk_fraction must be in"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"eta": 0.0}, "eta must be > 0"),
        ({"clip_low": 1.0}, "clip_low must be in"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"ema_decay": 1.0}, "ema_decay must be in"),
        ({"kl_coef": 0.1, "kl_ref": "reference", "lora_rank": 0}, "needs LoRA"),
        ({"eval_hybrid_steps": -1}, "eval_hybrid_steps must be >= 0"),
        ({"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
        ({"mixed_precision": "fp16"}, "mixed_precision must be one of auto, no, bf16"),
        ({"chunks": "2,3,4", "num_steps": 16, "sde_window": 0},
         "chunks: chunk sizes '2,3,4' sum to 9 but there are 15"),
        ({"chunks": "big"}, "chunks: chunks must be 'auto', 'step', 'sequence'"),
        ({"sde_window": -1}, "sde_window must be >= 0"),
        ({"chunks": "2,2", "sde_window": 3}, "sum to 4 but there are 3 trained"),
    ],
)
def test_invalid_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(None, overrides)


def test_dynamic_shift_follows_the_token_count(tmp_path):
    """dynamic_shift replaces `shift` by FLUX's exp(mu) of the image's latent token count."""
    import math

    from trainer_utils import tiny_model_dir

    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.schedule import dynamic_shift
    from chunk_grpo.trainer_setup import sampling_shift

    policy = FluxPolicy.from_pretrained(tiny_model_dir(tmp_path))  # 32x32: a 4x4 token grid
    fixed = build_config(None, {"shift": 2.0})
    assert sampling_shift(fixed, policy) == 2.0
    dyn = build_config(None, {"shift": 2.0, "dynamic_shift": True})
    assert sampling_shift(dyn, policy) == dynamic_shift(16)
    policy.height = policy.width = 64  # 8x8 tokens
    assert sampling_shift(dyn, policy) == pytest.approx(
        math.exp(0.5 + 0.65 / 3840 * (64 - 256)))
    # FLUX.1-dev at 720x720 (45x45 tokens): the value the preset's comment gives
    assert dynamic_shift(45 * 45) == pytest.approx(2.22, abs=0.005)


def test_antithetic_noise_needs_an_even_group():
    assert build_config(None, {"antithetic_noise": True, "group_size": 8}).antithetic_noise
    with pytest.raises(ConfigError, match="group_size must be even"):
        build_config(None, {"antithetic_noise": True, "group_size": 7})
