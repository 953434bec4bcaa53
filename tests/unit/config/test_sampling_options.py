"""The sampler's named choices exist once: the config, the CLIs and the samplers agree."""

import pytest

import grpo_kernels.validation
from chunk_grpo.cli.credit import credit_parser
from chunk_grpo.cli.evaluate import evaluate_parser
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.config.sampling_options import (
    SAMPLERS,
    SDE_KINDS,
    check_antithetic,
    check_decode,
    check_sde_kind,
    resolve_cfg_scale,
)
from chunk_grpo.models import FluxPolicy


def test_the_trainer_offers_exactly_the_kernels_kinds():
    assert SDE_KINDS == grpo_kernels.validation.SDE_KINDS
    assert SAMPLERS == ("ode", *SDE_KINDS)


def test_checks_name_the_problem_and_take_the_callers_error():
    with pytest.raises(ValueError, match=r"kind must be one of .*got 'ode'"):
        check_sde_kind("ode")
    with pytest.raises(ConfigError, match="decode must be 'final' or 'x0', got 'latent'"):
        check_decode("latent", error=ConfigError)
    with pytest.raises(ValueError, match="group_size must be even, got 3; give an even"):
        check_antithetic(True, 3)
    check_sde_kind("cps_mse"), check_decode("x0"), check_antithetic(True, 4)
    check_antithetic(False, 3)  # no pairs, no constraint


def test_config_and_command_lines_use_the_same_lists():
    for kind in SDE_KINDS:
        assert build_config(None, {"sampling.sde": kind}).sampling.sde == kind
    with pytest.raises(ConfigError, match="sampling.sde must be one of flow, dance, cps, cps_mse"):
        build_config(None, {"sampling.sde": "ode"})
    with pytest.raises(ConfigError, match="group_size must be even"):
        build_config(None, {"sampling.antithetic_noise": True, "sampling.group_size": 5})
    # evaluate samples with any of SAMPLERS, credit (the training config) with an SDE kind
    assert evaluate_parser().parse_config(["--sampling.sde", "ode"])[1].sampling.sde == "ode"
    for kind in SAMPLERS:
        assert evaluate_parser().parse_config(["--sampling.sde", kind])[1].sampling.sde == kind
    with pytest.raises(ConfigError, match="sampling.sde must be one of ode, flow, dance, cps"):
        evaluate_parser().parse_config(["--sampling.sde", "euler"])
    for kind in SDE_KINDS:
        assert credit_parser().parse_config(["--sampling.sde", kind])[1].sampling.sde == kind
    with pytest.raises(ConfigError, match="sampling.sde must be one of flow, dance, cps, cps_mse"):
        credit_parser().parse_config(["--sampling.sde", "ode"])


def test_cfg_scale_defaults_to_the_models(tiny_flux):
    policy = FluxPolicy.from_pretrained(tiny_flux)
    assert resolve_cfg_scale(policy, None) == policy.default_cfg_scale
    assert resolve_cfg_scale(policy, 0.0) == 0.0  # an explicit 0 is not "unset"
