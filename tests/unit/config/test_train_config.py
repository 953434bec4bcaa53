"""The training config: presets, command-line overrides, and clear errors for bad input."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.schema import (
    FLAT_ALIASES,
    PATHS,
    TrainConfig,
    build_config,
    flat_keys,
    load_saved_config,
    parse_args,
    save_config,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_default_preset_is_the_dataclass_default():
    assert build_config(CONFIGS / "default.yaml") == TrainConfig().validate()


def test_flux_preset_has_the_papers_settings():
    cfg = build_config(CONFIGS / "flux_dev_hpsv3.yaml")
    s = cfg.sampling
    assert (s.steps, s.shift, s.eta, s.group_size) == (17, 3.0, 0.7, 12)
    assert cfg.chunks.spec == "2,3,4,7" and cfg.chunks.fraction == 0.5
    assert (cfg.optim.lr, cfg.loss.clip_low, cfg.loss.clip_high, cfg.optim.max_grad_norm) == (
        1e-5, 5e-5, 5e-5, 0.01)
    assert (cfg.model.height, cfg.model.width, cfg.run.max_steps) == (720, 720, 150)
    assert cfg.model.mixed_precision == "bf16" and cfg.model.gradient_checkpointing


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
    assert cfg.sampling.group_size == 6 and cfg.optim.lr == 0.5 and cfg.loss.clip_low == 1e-3
    assert cfg.chunks.spec == "7,8" and cfg.sampling.cfg_scale is None
    assert cfg.sampling.shared_noise is True
    assert cfg.model.lora_targets == ["to_q", "to_v"]
    assert build_config(yml).chunks.spec == "2,3,4,6"  # a YAML list becomes the spec string


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
        ({"eval_hybrid_steps": -1}, "eval_hybrid_steps must be >= 0"),
        ({"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
        ({"mixed_precision": "fp16"}, "mixed_precision must be one of auto, no, bf16"),
        ({"parallel.reduce_dtype": "fp16"}, "parallel.reduce_dtype must be one of fp32, bf16"),
        ({"parallel.reduce_dtype": "bf16"},
         "parallel.reduce_dtype bf16 needs parallel.mode: fsdp .*; set it to fp32 or use fsdp"),
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

    from chunk_grpo.algorithm.sigmas import dynamic_shift
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.train.setup import sampling_shift

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
    assert build_config(None, {"antithetic_noise": True, "group_size": 8}).sampling.antithetic_noise
    with pytest.raises(ConfigError, match="group_size must be even"):
        build_config(None, {"antithetic_noise": True, "group_size": 7})


# ----------------------------------------------------------------------------- sections

# A run's config.yaml as earlier versions saved it (flat), with values off the defaults.
OLD_FLAT_CONFIG = """\
model: some/dir
reward: {test_brightness: 1.0, jpeg_compressibility: 0.5}
mix_advantage: per_reward
reward_device: cpu
reward_batch_size: 16
reward_overlap: false
reward_timeout: 0.0
train_prompts: shapes:train
eval_prompts: shapes:heldout
output_dir: runs/old
seed: 7
height: 64
width: 48
algorithm: chunk_grpo
g2rpo_granularities: 1,3
num_steps: 12
shift: 2.5
dynamic_shift: true
sde_kind: dance
eta: 0.5
cfg_scale: 2.0
group_size: 6
prompts_per_step: 3
shared_noise: false
antithetic_noise: true
sde_window: 0
decode: x0
rollout_batch_size: 32
chunks: 2,3,6
chunk_size: null
chunk_fraction: 0.5
weighted_chunks: true
profile_prompts: 4
max_chunk_size: 3
adv_norm: global
adv_clip_max: null
adv_eps: 0.001
clip_low: 0.002
clip_high: 0.003
kl_coef: 0.1
kl_ref: reference
max_steps: 9
max_minutes: 0.0
micro_batch_size: 2
grad_accum: 4
ppo_epochs: 2
optimizer: adamw8bit
lr: 0.0002
weight_decay: 0.01
adam_beta1: 0.8
adam_beta2: 0.99
adam_eps: 1.0e-06
max_grad_norm: 0.5
warmup_steps: 3
lr_schedule: cosine
mixed_precision: bf16
gradient_checkpointing: true
lora_rank: 4
lora_alpha: 8.0
lora_targets: [to_q, to_v]
ema_decay: 0.9
attention_backend: native
guidance: 3.5
parallelism: fsdp
cpu_offload: true
reduce_dtype: bf16
compile_blocks: true
weights_dtype: bf16
text_encoders: cache
prompt_cache_dir: /tmp/embeds
eval_every: 5
eval_images: 8
final_eval_images: 16
eval_hybrid_steps: 2
log_every: 2
image_grid_every: 0
checkpoint_every: 3
keep_checkpoints: 1
max_bad_steps: 2
device: cpu
progress: false
"""

# The same settings, nested: written out by hand (not derived from the alias table).
OLD_FLAT_AS_NESTED = {
    "model": dict(name="some/dir", height=64, width=48, mixed_precision="bf16",
                  weights_dtype="bf16", attention_backend="native", gradient_checkpointing=True,
                  compile_blocks=True, lora_rank=4, lora_alpha=8.0, lora_targets=["to_q", "to_v"],
                  base_quantization="none", guidance=3.5, text_encoders="cache",
                  prompt_cache_dir="/tmp/embeds", tf32=True),
    "reward": dict(name="test_brightness=1.0,jpeg_compressibility=0.5",
                   mix_advantage="per_reward", device="cpu", batch_size=16, overlap=False,
                   timeout=0.0),
    "data": dict(train_prompts="shapes:train", eval_prompts="shapes:heldout"),
    "sampling": dict(algorithm="chunk_grpo", g2rpo_granularities="1,3", steps=12, shift=2.5,
                     dynamic_shift=True, sde="dance", eta=0.5, cfg_scale=2.0, group_size=6,
                     prompts_per_step=3, shared_noise=False, antithetic_noise=True,
                     sde_window=0, decode="x0", batch_size=32),
    "chunks": dict(spec="2,3,6", size=None, fraction=0.5, weighted=True, profile_prompts=4,
                   max_size=3),
    "loss": dict(adv_norm="global", adv_clip_max=None, adv_eps=0.001, clip_low=0.002,
                 clip_high=0.003, kl_coef=0.1, kl_ref="reference"),
    "optim": dict(name="adamw8bit", lr=0.0002, weight_decay=0.01, beta1=0.8, beta2=0.99,
                  eps=1e-6, max_grad_norm=0.5, warmup_steps=3, schedule="cosine",
                  micro_batch_size=2, grad_accum=4, ppo_epochs=2, ema_decay=0.9),
    "parallel": dict(mode="fsdp", cpu_offload=True, reduce_dtype="bf16", timeout_minutes=60.0),
    "eval": dict(every=5, images=8, final_images=16, hybrid_steps=2, guard_reward="auto",
                 guard_stop=0.0),
    "run": dict(output_dir="runs/old", seed=7, device="cpu", max_steps=9, max_minutes=0.0,
                log_every=2, image_grid_every=0, checkpoint_every=3, keep_checkpoints=1,
                max_bad_steps=2, progress=False, export=["auto"],
                report_to=["tensorboard", "jsonl"], name="", wandb_project="chunk-grpo"),
}


def test_an_old_flat_config_loads_into_the_sections(tmp_path):
    """Every flat key of earlier versions is an alias of one dotted path: an old run's saved
    config.yaml resumes with the same settings."""
    old = tmp_path / "config.yaml"
    old.write_text(OLD_FLAT_CONFIG)
    cfg = build_config(old)
    assert cfg.to_dict() == OLD_FLAT_AS_NESTED
    assert sorted(FLAT_ALIASES) == sorted(yaml.safe_load(OLD_FLAT_CONFIG))
    # one dotted path per alias; the settings added since have none
    assert len(set(FLAT_ALIASES.values())) == len(FLAT_ALIASES)
    assert sorted(set(PATHS) - set(FLAT_ALIASES.values())) == [
        "eval.guard_reward", "eval.guard_stop", "model.base_quantization", "model.tf32",
        "parallel.timeout_minutes", "run.export",
        "run.name", "run.report_to", "run.wandb_project"]
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump(OLD_FLAT_AS_NESTED))
    assert build_config(nested) == cfg
    # flags on top of an old flat file (--resume): the flag wins, whichever name it uses
    assert build_config(old, {"optim.lr": "3e-4"}).optim.lr == 3e-4
    assert build_config(old, {"lr": 5e-4}).optim.lr == 5e-4


def test_dotted_flags_in_both_spellings_and_their_aliases():
    _, overrides, _ = parse_args(["--optim.lr", "1e-4", "--eval.every=10", "--chunks.fraction",
                                  "0.5", "--reward.name=test_brightness", "--chunks.spec", "-1,4",
                                  "--optim.max-grad-norm", "0.25", "--group-size", "4"])
    assert overrides == {"optim.lr": "1e-4", "eval.every": "10", "chunks.fraction": "0.5",
                         "reward.name": "test_brightness", "chunks.spec": "-1,4",
                         "optim.max_grad_norm": "0.25", "group_size": "4"}
    overrides["chunks.spec"] = "auto"
    cfg = build_config(None, overrides)
    assert (cfg.optim.lr, cfg.eval.every, cfg.chunks.fraction) == (1e-4, 10, 0.5)
    assert (cfg.reward.name, cfg.optim.max_grad_norm, cfg.sampling.group_size) == (
        "test_brightness", 0.25, 4)
    assert build_config(None, {"lr": 1e-4}) == build_config(None, {"optim.lr": 1e-4})
    assert cfg.get("lr") == cfg.get("optim.lr") == 1e-4
    with pytest.raises(ConfigError, match=r"optim.lr is given twice .*--lr and --optim.lr"):
        parse_args(["--lr", "1", "--optim.lr", "2"])


def test_a_nested_yaml_takes_sections_dotted_keys_and_aliases(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("optim:\n  lr: 2.0e-4\n  max-grad-norm: 0.5\n"
                    "sampling: {steps: 12, sde: dance}\n"
                    "loss.kl_coef: 0.05\n"
                    "group_size: 4\n"
                    "reward:\n  name: {test_brightness: 1.0, jpeg_compressibility: 0.5}\n"
                    "  overlap: false\n"
                    "eval:\n")  # an empty section
    cfg = build_config(path)
    assert (cfg.optim.lr, cfg.optim.max_grad_norm, cfg.sampling.steps) == (2e-4, 0.5, 12)
    assert (cfg.sampling.sde, cfg.loss.kl_coef, cfg.sampling.group_size) == ("dance", 0.05, 4)
    assert cfg.reward.name == "test_brightness=1.0,jpeg_compressibility=0.5"
    assert cfg.reward.overlap is False and cfg.eval == TrainConfig().eval
    # a section's own flat name with a plain value is its alias: model: DIR, chunks: [1, 2]
    path.write_text("model: some/dir\nchunks: [1, 2, 3]\nreward: {test_brightness: 1.0}\n")
    cfg = build_config(path)
    assert (cfg.model.name, cfg.chunks.spec) == ("some/dir", "1,2,3")
    assert cfg.reward.name == "test_brightness"  # a weight of 1 is the plain name


@pytest.mark.parametrize(("where", "key", "message"), [
    ("flag", "--optim.lrr", r"unknown config key 'optim.lrr' in the command line; did you mean "
                            r"'optim.lr'\?"),
    ("flag", "--sampling.lr", r"unknown config key 'sampling.lr'.*did you mean 'optim.lr'\?"),
    ("flag", "--optm.lr", r"unknown config section 'optm'.*did you mean section 'optim'\?"),
    ("flag", "--group-sise", r"unknown config key 'group_sise'.*did you mean 'group_size'\?"),
    ("flag", "--fraction", r"'fraction' in the command line; did you mean 'chunks.fraction'\?"),
    ("flag", "--run.batch-size", r"did you mean 'reward.batch_size' or 'sampling.batch_size'\?"),
    ("yaml", "optim:\n  lrr: 1\n", r"unknown config key 'optim.lrr' in .*'optim.lr'\?"),
    ("yaml", "chunks.fractoin: 0.5\n", r"'chunks.fractoin'.*did you mean 'chunks.fraction'\?"),
    ("yaml", "optim: 3\n", r"optim in .* is a section: give it a mapping such as `optim: "
                           r"\{name: ...\}` or a dotted key `optim.name`, not 3"),
    ("yaml", "eval: fast\n", "eval in .* is a section"),
])
def test_unknown_keys_and_scalar_sections_are_errors(tmp_path, where, key, message):
    with pytest.raises(ConfigError, match=message):
        if where == "flag":
            parse_args([key, "1"])
        else:
            path = tmp_path / "bad.yaml"
            path.write_text(key)
            build_config(path)


def test_messages_name_the_key_as_written():
    with pytest.raises(ConfigError, match=r"^chunk_fraction must be in \(0, 1\]"):
        build_config(None, {"chunk_fraction": 0.0})
    with pytest.raises(ConfigError, match=r"^chunks.fraction must be in \(0, 1\]"):
        build_config(None, {"chunks.fraction": 0.0})
    with pytest.raises(ConfigError, match=r"^optim.lr expects float, got 'fast'"):
        build_config(None, {"optim": {"lr": "fast"}})
    with pytest.raises(ConfigError, match="sampling.group_size must be >= 2 for group "
                                          "advantages; set loss.adv_norm: none"):
        build_config(None, {"sampling.group_size": 1})


def test_the_saved_config_is_nested_and_round_trips(tmp_path):
    cfg = build_config(None, {"optim.lr": 3e-4, "chunks.size": 3, "loss.adv_clip_max": None,
                              "model.lora_targets": "to_q,to_k", "reward": "test_brightness"})
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert list(saved) == ["model", "reward", "data", "sampling", "chunks", "loss", "optim",
                           "parallel", "eval", "run"]
    assert saved["optim"]["lr"] == 3e-4 and saved["chunks"]["size"] == 3
    assert saved["model"]["lora_targets"] == ["to_q", "to_k"]
    assert load_saved_config(tmp_path / "config.yaml") == cfg


def test_with_changes_copies_and_converts():
    cfg = TrainConfig()
    changed = cfg.with_changes({"max_grad_norm": math.inf, "chunks.fraction": "0.5",
                                "model": "other"})
    assert (changed.optim.max_grad_norm, changed.chunks.fraction) == (math.inf, 0.5)
    assert changed.model.name == "other" and changed.model.lora_rank == cfg.model.lora_rank
    assert cfg == TrainConfig()  # the original is untouched
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        cfg.with_changes({"optim.lrr": 1})


def test_flat_keys_maps_any_spelling_to_the_aliases():
    assert flat_keys({"optim": {"lr": 1}, "sampling.group_size": 4, "seed": 2}, "x") == {
        "lr": 1, "group_size": 4, "seed": 2}


def test_help_lists_the_dotted_flags_by_section(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    sections = [line.rstrip(":") for line in text.splitlines() if re.fullmatch(r"\w+:", line)]
    assert sections == ["options", "model", "reward", "data", "sampling", "chunks", "loss",
                        "optim", "parallel", "eval", "run"]
    assert re.search(r"--optim\.lr V +default 0\.001 \(alias --lr\)", text)
    assert re.search(r"--sampling\.sde V +flow\|dance\|cps\|cps_mse, default 'flow' \(alias "
                     r"--sde-kind\)", text)


def test_the_config_module_imports_no_torch():
    """A command checks its flags before torch loads: the config and the commands' entry points
    import none of it."""
    code = ("import sys, chunk_grpo.config.schema, chunk_grpo.config.checks, "
            "chunk_grpo.cli.main, chunk_grpo.cli.train, chunk_grpo.cli.evaluate; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpo_kernels', "
            "'diffusers', 'numpy') or m.startswith('chunk_grpo.algorithm.')))")
    env = {**os.environ, "PYTHONPATH": str(CONFIGS.parent)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "[]"




@pytest.mark.parametrize(("overrides", "match"), [
    ({"eval.guard_reward": "clip=x"}, r"^eval.guard_reward: reward entry 'clip=x': the weight "
                                      r".* \(or auto, or none for no guard\)$"),
    ({"eval.guard_reward": ""}, r"^eval.guard_reward: reward is empty"),
    ({"eval.guard_stop": -0.1}, r"^eval.guard_stop must be >= 0, got -0.1$"),
    ({"eval.guard_stop": "nan"}, r"^eval.guard_stop must be a finite number"),
    ({"eval.guard_stop": 0.05, "eval.guard_reward": "none"},
     r"^eval.guard_stop 0.05 has no guard to watch: eval.guard_reward is none; name one"),
    ({"eval.guard_stop": 0.05, "reward": "shapes"},
     r"^eval.guard_stop 0.05 has no guard to watch: eval.guard_reward is auto, which finds"),
    ({"eval.guard_stop": 0.05, "eval_prompts": "prompts.txt"}, r"has no guard to watch"),
    ({"eval.guard_stop": 0.05, "eval.every": 0},
     r"^eval.guard_stop 0.05 is checked at the periodic evaluations, and eval.every: 0 runs "
     r"none; set eval.every >= 1 or eval.guard_stop: 0$"),
    ({"eval.guard_stop": 0.05, "eval_hybrid_steps": 0},
     r"^eval.guard_stop 0.05 compares the guard with the base model's .* and "
     r"eval_hybrid_steps: 0 loads no base; set eval_hybrid_steps >= 1"),
    ({"eval.guard_stop": 0.05, "eval.images": 1}, r"^eval.guard_stop 0.05 needs a confidence "
                                                  r"interval .*set eval.images >= 2"),
])
def test_bad_guard_settings_are_one_line_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(None, overrides)


def test_the_guard_spec_resolves_auto_and_none():
    from chunk_grpo.config.reward_spec import resolve_guard_spec

    def guard(spec, reward="jpeg_compressibility", eval_prompts="shapes:heldout"):
        return resolve_guard_spec(spec, reward=reward, eval_prompts=eval_prompts)

    assert guard("auto") == "shapes" and guard(" Auto ") == "shapes"
    assert guard("auto", reward="shapes") is None  # its own evaluation reports the checks
    assert guard("auto", eval_prompts="my_prompts.txt") is None
    assert guard("none") is None and guard("NONE") is None
    assert guard("shapes-clip", reward="shapes") == "shapes-clip"
    assert guard("pickscore=1.0,clip=0.5") == "pickscore=1.0,clip=0.5"
    cfg = build_config(None, {"eval.guard_stop": 0.05, "eval.guard_reward": "shapes"})
    assert (cfg.eval.guard_stop, cfg.eval.guard_reward) == (0.05, "shapes")
    mix = build_config(None, {"eval": {"guard_reward": {"shapes": 1.0, "clip": 0.5}}})
    assert mix.eval.guard_reward == "shapes=1.0,clip=0.5"
