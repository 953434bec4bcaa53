"""LoRA target presets on a FLUX-shaped transformer (1 double + 1 single block, FLUX's module
names), module-name lists as before, and errors for names that match nothing."""

import pytest
import torch
from trainer_utils import TINY_SIZES

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.config.specs import LORA_PRESETS, lora_target_modules
from chunk_grpo.models.policy_setup import prepare_transformer
from chunk_grpo.models.tiny import build_tiny_flux_pipeline

DOUBLE, SINGLE = "transformer_blocks.0.", "single_transformer_blocks.0."
ATTENTION = {DOUBLE + "attn.to_q", DOUBLE + "attn.to_k", DOUBLE + "attn.to_v",
             DOUBLE + "attn.to_out.0",
             SINGLE + "attn.to_q", SINGLE + "attn.to_k", SINGLE + "attn.to_v"}
TEXT = {DOUBLE + "attn.add_q_proj", DOUBLE + "attn.add_k_proj", DOUBLE + "attn.add_v_proj",
        DOUBLE + "attn.to_add_out"}
REST = {DOUBLE + "ff.net.0.proj", DOUBLE + "ff.net.2", DOUBLE + "ff_context.net.0.proj",
        DOUBLE + "ff_context.net.2", DOUBLE + "norm1.linear", DOUBLE + "norm1_context.linear",
        SINGLE + "proj_mlp", SINGLE + "proj_out", SINGLE + "norm.linear"}


def _wrapped(targets) -> set[str]:
    transformer = build_tiny_flux_pipeline(["a"], **TINY_SIZES).transformer
    prepare_transformer(transformer, lora_rank=2, lora_alpha=None, lora_targets=targets,
                        gradient_checkpointing=False, attention_backend="native")
    return {n for n, m in transformer.named_modules() if hasattr(m, "lora_A")}


@pytest.mark.parametrize("preset, expected", [
    ("attention", ATTENTION),
    ("attention+text", ATTENTION | TEXT),
    ("all", ATTENTION | TEXT | REST),
])
def test_each_preset_wraps_exactly_its_modules(preset, expected):
    assert _wrapped([preset]) == expected
    assert _wrapped(preset) == expected


def test_all_covers_every_linear_layer_of_the_blocks_and_nothing_outside():
    transformer = build_tiny_flux_pipeline(["a"], **TINY_SIZES).transformer
    in_blocks = {n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)
                 and n.startswith(("transformer_blocks.", "single_transformer_blocks."))}
    assert in_blocks == ATTENTION | TEXT | REST
    assert len(LORA_PRESETS["all"]) == len(set(LORA_PRESETS["all"]))


def test_module_name_lists_keep_peft_suffix_matching():
    assert _wrapped(["to_q", "to_k", "to_v", "to_out.0"]) == ATTENTION
    # A plain name matches everywhere, the top-level output projection included.
    assert _wrapped(["proj_out"]) == {SINGLE + "proj_out", "proj_out"}


@pytest.mark.parametrize("targets, message", [
    (["to_qq"], r"'to_qq' is neither a preset \(attention, attention\+text, all\)"),
    (["to_q", "attention"], "cannot be mixed"),
    ([], "lora_targets is empty"),
])
def test_bad_targets_name_the_presets(targets, message):
    with pytest.raises(ValueError, match=message):
        _wrapped(targets)


def test_the_config_takes_a_preset_name_and_defaults_to_both_attention_streams():
    assert TrainConfig().model.lora_targets == ["attention+text"]
    assert lora_target_modules(TrainConfig().model.lora_targets) == [
        *LORA_PRESETS["attention"], *LORA_PRESETS["attention+text"][4:]]
    assert build_config(None, {"model.lora_targets": "all"}).model.lora_targets == ["all"]
    assert build_config(None, {"model.lora_targets": "to_q,to_v"}).model.lora_targets == ["to_q",
                                                                                          "to_v"]
    with pytest.raises(ConfigError, match="lora_targets: the preset 'all' cannot be mixed"):
        build_config(None, {"model.lora_targets": "all,to_q"})
