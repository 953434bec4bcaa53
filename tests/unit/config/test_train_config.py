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
from chunk_grpo.config.parsing import (
    build_config,
    config_from_saved,
    load_saved_config,
    parse_args,
    save_config,
)
from chunk_grpo.config.schema import ChunksConfig, ModelConfig, SamplingConfig, TrainConfig

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
        ["--config", "x.yaml", "--sampling.group_size", "6", "--loss.clip_low", "1e-3",
         "--chunks.spec", "7,8", "--sampling.steps", "16", "--sampling.sde_window", "0",
         "--sampling.cfg_scale", "null", "--sampling.shared_noise", "true",
         "--model.lora_targets", "to_q,to_v"])
    assert path == "x.yaml" and resume is None
    yml = tmp_path / "x.yaml"
    yml.write_text(yaml.safe_dump({"sampling": {"group_size": 3, "steps": 16, "sde_window": 0},
                                   "optim.lr": 0.5, "chunks": {"spec": [2, 3, 4, 6]}}))
    cfg = build_config(yml, overrides)
    assert cfg.sampling.group_size == 6 and cfg.optim.lr == 0.5 and cfg.loss.clip_low == 1e-3
    assert cfg.chunks.spec == "7,8" and cfg.sampling.cfg_scale is None
    assert cfg.sampling.shared_noise is True
    assert cfg.model.lora_targets == ["to_q", "to_v"]
    assert build_config(yml).chunks.spec == "2,3,4,6"  # a YAML list becomes the spec string


def test_saved_config_round_trips(tmp_path):
    cfg = build_config(None, {"sampling.group_size": 5, "chunks.size": 3,
                              "loss.adv_clip_max": None})
    save_config(cfg, tmp_path / "config.yaml")
    assert build_config(tmp_path / "config.yaml") == cfg


def test_unknown_keys_are_errors(tmp_path):
    yml = tmp_path / "bad.yaml"
    yml.write_text("sampling:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match="unknown config key 'sampling.group_sise'.*"
                                          "'sampling.group_size'"):
        build_config(yml)
    with pytest.raises(ConfigError, match="unknown config key 'learning_rat'"):
        parse_args(["--learning-rat", "3"])
    with pytest.raises(ConfigError, match="either --config or --resume"):
        parse_args(["--config", "a.yaml", "--resume", "runs/x"])
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(tmp_path / "missing.yaml")


def test_sde_window_sets_the_trained_transitions():
    cfg = build_config(None, {"sampling.steps": 10, "sampling.sde_window": 4, "chunks.spec": "1,3"})
    assert cfg.num_trained == 4
    assert build_config(None, {"sampling.steps": 10, "sampling.sde_window": 0}).num_trained == 9


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"sampling.group_size": "four"}, r"^sampling.group_size must be an int, got 'four'$"),
        ({"sampling.group_size": 2.5}, "sampling.group_size must be an int, got 2.5"),
        ({"optim.lr": "fast"}, r"^optim.lr must be a float, got 'fast'$"),
        ({"sampling.shared_noise": "maybe"}, "sampling.shared_noise must be true or false"),
        ({"sampling.group_size": None}, "sampling.group_size cannot be null; give an int"),
        ({"sampling.sde": "euler"}, "sampling.sde must be one of flow, dance, cps, cps_mse"),
        ({"loss.adv_norm": "batch"}, "loss.adv_norm must be one of"),
        ({"sampling.group_size": 1}, "sampling.group_size must be >= 2"),
        ({"sampling.steps": 1}, "sampling.steps must be >= 2"),
        ({"chunks.fraction": 0.0}, r"^chunks.fraction must be in \(0, 1\]"),
        ({"chunks.size": 0}, "chunks.size must be >= 1"),
        ({"sampling.eta": 0.0}, "sampling.eta must be > 0"),
        ({"loss.clip_low": 1.0}, "loss.clip_low must be in"),
        ({"optim.lr": 0.0}, "optim.lr must be > 0"),
        ({"optim.lr": "nan"}, "optim.lr must be a finite number"),
        ({"optim.max_grad_norm": float("inf")}, "optim.max_grad_norm must be a finite number"),
        ({"optim.ema_decay": 1.0}, "optim.ema_decay must be in"),
        ({"eval.hybrid_steps": -1}, "eval.hybrid_steps must be >= 0"),
        ({"optim.micro_batch_size": 0}, "optim.micro_batch_size must be >= 1"),
        ({"model.mixed_precision": "fp16"}, "model.mixed_precision must be one of auto, no, "
                                            "bf16; got 'fp16'"),
        ({"model.mixed_precision": False}, "got False \\(YAML reads an unquoted yes, no, on or "
                                           "off as true or false: quote the word\\)"),
        ({"parallel.reduce_dtype": "fp16"}, "parallel.reduce_dtype must be one of fp32, bf16"),
        ({"parallel.reduce_dtype": "bf16"},
         "parallel.reduce_dtype bf16 needs parallel.mode: fsdp .*; set it to fp32 or use fsdp"),
        ({"chunks.spec": "2,3,4", "sampling.steps": 16, "sampling.sde_window": 0},
         "chunks.spec: chunk sizes '2,3,4' sum to 9 but there are 15"),
        ({"chunks.spec": "big"}, "chunks.spec: chunks must be 'auto', 'step', 'sequence'"),
        ({"sampling.sde_window": -1}, "sampling.sde_window must be >= 0"),
        ({"chunks.spec": "2,2", "sampling.sde_window": 3}, "sum to 4 but there are 3 trained"),
    ],
)
def test_invalid_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(None, overrides)


def test_dynamic_shift_follows_the_token_count(tiny_flux):
    """dynamic_shift replaces `shift` by FLUX's exp(mu) of the image's latent token count."""


    from chunk_grpo.algorithm.sigmas import dynamic_shift
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.train.setup import sampling_shift

    policy = FluxPolicy.from_pretrained(tiny_flux)  # 32x32: a 4x4 token grid
    fixed = build_config(None, {"sampling.shift": 2.0})
    assert sampling_shift(fixed, policy) == 2.0
    dyn = build_config(None, {"sampling.shift": 2.0, "sampling.dynamic_shift": True})
    assert sampling_shift(dyn, policy) == dynamic_shift(16)
    policy.height = policy.width = 64  # 8x8 tokens
    assert sampling_shift(dyn, policy) == pytest.approx(
        math.exp(0.5 + 0.65 / 3840 * (64 - 256)))
    # FLUX.1-dev at 720x720 (45x45 tokens): the value the preset's comment gives
    assert dynamic_shift(45 * 45) == pytest.approx(2.22, abs=0.005)


def test_antithetic_noise_needs_an_even_group():
    cfg = build_config(None, {"sampling.antithetic_noise": True, "sampling.group_size": 8})
    assert cfg.sampling.antithetic_noise
    with pytest.raises(ConfigError, match="group_size must be even"):
        build_config(None, {"sampling.antithetic_noise": True, "sampling.group_size": 7})


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


def test_an_old_saved_config_resumes_with_its_settings(tmp_path):
    """A run saved by an earlier version (every setting at the top level) is migrated: its
    config.yaml and its checkpoint's copy give the same settings. Elsewhere flat keys are errors
    that name the dotted key."""
    old = tmp_path / "config.yaml"
    old.write_text(OLD_FLAT_CONFIG)
    cfg = load_saved_config(old)
    assert cfg.to_dict() == OLD_FLAT_AS_NESTED
    assert config_from_saved(yaml.safe_load(OLD_FLAT_CONFIG)) == cfg
    assert build_config(old, {"optim.lr": "3e-4"}, saved=True).optim.lr == 3e-4
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump(OLD_FLAT_AS_NESTED))
    assert build_config(nested) == cfg == load_saved_config(nested)
    with pytest.raises(ConfigError, match=r"model in .*config.yaml is a section: give it a "
                                          r"mapping such as `model: \{name: ...\}`"):
        build_config(old)  # as a preset (--config), a flat file is refused
    old.write_text("num_steps: 12\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'num_steps' .*'sampling.steps'"):
        build_config(old)


def test_dotted_flags_in_both_forms():
    _, overrides, _ = parse_args(["--optim.lr", "1e-4", "--eval.every=10", "--chunks.fraction",
                                  "0.5", "--reward.name=test_brightness", "--chunks.spec", "-1,4",
                                  "--optim.max_grad_norm", "0.25", "--run.export", "merged,lora"])
    assert overrides == {"optim.lr": "1e-4", "eval.every": 10, "chunks.fraction": 0.5,
                         "reward.name": "test_brightness", "chunks.spec": "-1,4",
                         "optim.max_grad_norm": 0.25, "run.export": "merged,lora"}
    overrides["chunks.spec"] = "auto"
    cfg = build_config(None, overrides)
    assert (cfg.optim.lr, cfg.eval.every, cfg.chunks.fraction) == (1e-4, 10, 0.5)
    assert (cfg.reward.name, cfg.optim.max_grad_norm, cfg.run.export) == (
        "test_brightness", 0.25, ["merged", "lora"])
    assert cfg.get("optim.lr") == 1e-4
    with pytest.raises(ConfigError, match=r"unknown config key 'lr'.*did you mean 'optim.lr'"):
        parse_args(["--lr", "1"])
    assert parse_args(["--optim.max-grad-norm", "0.5"])[1] == {"optim.max_grad_norm": 0.5}
    # a word stays a word where the key takes text, though YAML reads `no` as false
    assert parse_args(["--model.mixed_precision", "no", "--run.progress", "no"])[1] == {
        "model.mixed_precision": "no", "run.progress": False}
    with pytest.raises(ConfigError, match="^optim.lr is given twice on the command line"):
        parse_args(["--optim.lr", "1", "--optim.lr=2"])


def test_a_nested_yaml_takes_sections_and_dotted_keys(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("optim:\n  lr: 2.0e-4\n  max_grad_norm: 0.5\n"
                    "sampling: {steps: 12, sde: dance}\n"
                    "loss.kl_coef: 0.05\n"
                    "reward:\n  name: {test_brightness: 1.0, jpeg_compressibility: 0.5}\n"
                    "  overlap: false\n"
                    "eval:\n")  # an empty section
    cfg = build_config(path)
    assert (cfg.optim.lr, cfg.optim.max_grad_norm, cfg.sampling.steps) == (2e-4, 0.5, 12)
    assert (cfg.sampling.sde, cfg.loss.kl_coef) == ("dance", 0.05)
    assert cfg.reward.name == "test_brightness=1.0,jpeg_compressibility=0.5"
    assert cfg.reward.overlap is False and cfg.eval == TrainConfig().eval
    path.write_text("reward: {name: {test_brightness: 1.0}}\nchunks.spec: [1, 2, 3]\n"
                    "sampling.steps: 7\n")
    cfg = build_config(path)
    assert cfg.reward.name == "test_brightness" and cfg.chunks.spec == "1,2,3"
    path.write_text("loss.kl_coef: 0.1\nloss:\n  kl_coef: 0.2\n")
    with pytest.raises(ConfigError, match="loss.kl_coef is given twice"):
        build_config(path)


@pytest.mark.parametrize(("where", "key", "message"), [
    ("flag", "--optim.lrr", r"unknown config key 'optim.lrr' in the command line; did you mean "
                            r"'optim.lr'\?"),
    ("flag", "--sampling.lr", r"unknown config key 'sampling.lr'.*did you mean 'optim.lr'\?"),
    ("flag", "--optm.lr", r"unknown config key 'optm.lr'.*did you mean 'optim.lr'\?"),
    ("flag", "--group-size", r"unknown config key 'group_size'.*'sampling.group_size'\?"),
    ("flag", "--fraction", r"'fraction' in the command line; did you mean 'chunks.fraction'\?"),
    ("flag", "--run.batch-size", r"did you mean 'reward.batch_size' or 'sampling.batch_size'\?"),
    ("flag", "--model", r"--model is a section; set its keys, e.g. --model.name VALUE"),
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


def test_every_way_of_building_a_config_checks_it():
    """The sections check themselves in __post_init__: the constructor, with_changes and
    validate() after an assignment all refuse a bad value with the same one-line message."""
    with pytest.raises(ConfigError, match=r"^chunks.fraction must be in \(0, 1\]"):
        ChunksConfig(fraction=0.0)
    with pytest.raises(ConfigError, match="^model.mixed_precision must be one of auto, no, bf16"):
        ModelConfig(mixed_precision="fp16")
    with pytest.raises(ConfigError, match="sampling.group_size must be >= 2 for group "
                                          "advantages; set loss.adv_norm: none"):
        TrainConfig(sampling=SamplingConfig(group_size=1))
    with pytest.raises(ConfigError, match="sampling.group_size must be >= 2 for group"):
        build_config(None, {"sampling.group_size": 1})
    cfg = TrainConfig()
    cfg.optim.lr = -1.0
    with pytest.raises(ConfigError, match="^optim.lr must be > 0, got -1.0$"):
        cfg.validate()


def test_the_saved_config_is_nested_and_round_trips(tmp_path):
    cfg = build_config(None, {"optim.lr": 3e-4, "chunks.size": 3, "loss.adv_clip_max": None,
                              "model.lora_targets": "to_q,to_k", "reward.name": "test_brightness"})
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert list(saved) == ["model", "reward", "data", "sampling", "chunks", "loss", "optim",
                           "parallel", "eval", "run"]
    assert saved["optim"]["lr"] == 3e-4 and saved["chunks"]["size"] == 3
    assert saved["model"]["lora_targets"] == ["to_q", "to_k"]
    assert load_saved_config(tmp_path / "config.yaml") == cfg


def test_with_changes_copies_converts_and_checks():
    cfg = TrainConfig()
    changed = cfg.with_changes({"optim.max_grad_norm": 0.5, "chunks.fraction": "0.5",
                                "model.name": "other"})
    assert (changed.optim.max_grad_norm, changed.chunks.fraction) == (0.5, 0.5)
    assert changed.model.name == "other" and changed.model.lora_rank == cfg.model.lora_rank
    assert cfg == TrainConfig()  # the original is untouched
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        cfg.with_changes({"optim.lrr": 1})
    with pytest.raises(ConfigError, match="optim.max_grad_norm must be > 0"):
        cfg.with_changes({"optim.max_grad_norm": 0})


def test_help_lists_the_dotted_flags_by_section(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    sections = [line.rstrip(":") for line in text.splitlines() if re.fullmatch(r"\w+:", line)]
    assert sections == ["options", "model", "reward", "data", "sampling", "chunks", "loss",
                        "optim", "parallel", "eval", "run"]
    assert re.search(r"--optim\.lr FLOAT +default 0\.001", text)
    assert re.search(r"--sampling\.sde \{flow,dance,cps,cps_mse\}\s+the stochastic sampler; "
                     r"default flow", text)
    assert re.search(r"--model\.height INT\|NULL +None = the model's default size; default null",
                     text)


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
    ({"eval.guard_stop": 0.05, "reward.name": "shapes"},
     r"^eval.guard_stop 0.05 has no guard to watch: eval.guard_reward is auto, which finds"),
    ({"eval.guard_stop": 0.05, "data.eval_prompts": "prompts.txt"}, r"has no guard to watch"),
    ({"eval.guard_stop": 0.05, "eval.every": 0},
     r"^eval.guard_stop 0.05 is checked at the periodic evaluations, and eval.every: 0 runs "
     r"none; set eval.every >= 1 or eval.guard_stop: 0$"),
    ({"eval.guard_stop": 0.05, "eval.hybrid_steps": 0},
     r"^eval.guard_stop 0.05 compares the guard with the base model's .* and "
     r"eval.hybrid_steps: 0 loads no base; set eval.hybrid_steps >= 1"),
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
