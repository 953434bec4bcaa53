"""QLoRA on the CPU: the frozen base quantized by bitsandbytes (nf4, int8) under fp32 LoRA
adapters; a run trains and exports the dequantized base with the LoRA merged; the config's
errors; the memory plan's arithmetic of a quantized base."""

import copy
import dataclasses
import importlib.util
import math

import pytest
import torch
from safetensors import safe_open
from trainer_utils import tiny_config, velocities

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.policy_setup import load_trainable_state_dict, prepare_transformer
from chunk_grpo.models.quantize import (
    block_linears,
    dequantized_weight,
    quantize_base,
    quantize_linear,
)
from chunk_grpo.plan.memory import GB, build_plan, plan_for_config, settings_from_config
from chunk_grpo.plan.quantized import (
    int8_layer_bytes,
    nf4_layer_bytes,
    quantized_base_bytes,
    quantized_layers,
)
from chunk_grpo.train.checkpoint import latest_checkpoint, load_checkpoint
from chunk_grpo.train.loop import run
from chunk_grpo.train.metrics import read_metrics

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

bnb = pytest.importorskip("bitsandbytes")
BNB_CLASSES = {"nf4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}
STORAGE = {"nf4": torch.uint8, "int8": torch.int8}


@pytest.fixture(scope="module")
def model_dir(tiny_flux):
    return tiny_flux


def call_inputs(transformer, rows: int = 2) -> dict:
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(rows, 16, config.in_channels, generator=generator),
                timestep=torch.rand(rows, generator=generator),
                pooled_projections=torch.randn(rows, config.pooled_projection_dim,
                                               generator=generator),
                encoder_hidden_states=torch.randn(rows, 8, config.joint_attention_dim,
                                                  generator=generator),
                txt_ids=torch.zeros(8, 3), img_ids=torch.zeros(16, 3), return_dict=False)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_loading_wraps_bnb_layers_with_fp32_adapters(model_dir, kind):
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import bnb as peft_bnb

    policy = FluxPolicy.from_pretrained(model_dir)
    transformer = policy.transformer
    plain = copy.deepcopy(transformer)
    originals = {id(c): c.weight.detach().clone() for _, _, c in block_linears(transformer)}
    names = {id(c): n for n, c in transformer.named_modules()}
    originals = {names[k]: w for k, w in originals.items()}
    count = len(originals)
    assert quantize_base(transformer, kind, compute_dtype=torch.float32, device="cpu") == count
    assert count > 0 and not block_linears(transformer)  # no plain linear left in the blocks
    layers = dict(transformer.named_modules())
    for name, original in originals.items():  # each within the format's resolution
        relative = float((dequantized_weight(layers[name]) - original).norm() / original.norm())
        assert relative < (0.12 if kind == "nf4" else 0.01), (name, relative)
    prepare_transformer(transformer, lora_rank=4, lora_alpha=None,
                        lora_targets="attention+text", gradient_checkpointing=True,
                        attention_backend="native", lora_seed=0)
    quantized = [m for m in transformer.modules() if isinstance(m, BNB_CLASSES[kind])]
    assert len(quantized) == count
    assert all(m.weight.dtype == STORAGE[kind] and not m.weight.requires_grad for m in quantized)
    # peft dispatched its bitsandbytes LoRA layers onto the quantized ones
    adapted = [m for m in transformer.modules() if isinstance(m, LoraLayer)]
    lora_class = peft_bnb.Linear4bit if kind == "nf4" else peft_bnb.Linear8bitLt
    assert adapted and all(isinstance(m, lora_class) for m in adapted)
    assert all(isinstance(m.get_base_layer(), BNB_CLASSES[kind]) for m in adapted)
    trainable = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32
                             for n, p in trainable.items())
    # the root (embedders, final projection) stays in the weights' dtype, unquantized
    assert type(transformer.x_embedder) is torch.nn.Linear
    assert transformer.x_embedder.weight.dtype == torch.float32
    # with B = 0 the adapted quantized model computes the plain model up to quantization error
    with torch.no_grad():
        want = plain(**call_inputs(plain))[0]
        got = transformer(**call_inputs(transformer))[0]
    error = float((got - want).norm() / want.norm())
    assert 0 < error < (0.2 if kind == "nf4" else 0.05), error


@pytest.mark.slow
def test_nf4_lora_run_trains_and_exports_the_dequantized_merged_base(tmp_path, model_dir):
    cfg = tiny_config(model_dir, tmp_path / "run", {"run.max_steps": 2, "model.lora_rank": 8,
                                                    "optim.lr": 1e-2,
                                                    "optim.name": "adamw8bit",
                                                    "eval.hybrid_steps": 2,
                                                    "run.checkpoint_every": 1,
                                                    **{"model.base_quantization": "nf4"}})
    out = run(cfg)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert all(r[k] == 1.0 for r in records for k in r if k.endswith("/ratio_mean"))
    first = load_checkpoint(out / "checkpoints" / "step-00000001")["model"]
    last = load_checkpoint(latest_checkpoint(out))["model"]
    assert first and all("lora_" in n and v.dtype == torch.float32 for n, v in last.items())
    assert any(not torch.equal(first[n], last[n]) for n in last)  # the adapters moved

    # The export: the same base quantized the same way, dequantized, the LoRA merged, bf16.
    trained = FluxPolicy.from_pretrained(model_dir)
    quantize_base(trained.transformer, "nf4", compute_dtype=torch.float32, device="cpu")
    prepare_transformer(trained.transformer, lora_rank=8, lora_alpha=None,
                        lora_targets=cfg.model.lora_targets, gradient_checkpointing=False,
                        attention_backend="native")
    load_trainable_state_dict(trained.transformer, last)
    weights = out / "final_model" / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(weights, framework="pt") as handle:
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}
    exported = FluxPolicy.from_pretrained(out / "final_model")  # fp32 from the bf16 file
    state = exported.transformer.state_dict()
    for name, module in trained.transformer.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            scale = module.scaling["default"]
            want = dequantized_weight(module.get_base_layer()) + scale * (
                module.lora_B["default"].weight @ module.lora_A["default"].weight)
            torch.testing.assert_close(state[name + ".weight"].float(), want.detach(),
                                       rtol=1e-2, atol=1e-3)
    v_trained, v_exported, v_base = velocities(trained, exported,
                                               FluxPolicy.from_pretrained(model_dir))
    # bf16 storage of the merged weights: equal to the trained model to bf16's resolution
    assert float((v_exported - v_trained).norm() / v_trained.norm()) < 2e-2
    assert float((v_base - v_trained).norm() / v_trained.norm()) > \
        float((v_exported - v_trained).norm() / v_trained.norm())


def test_config_errors_name_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match=r"^model.base_quantization nf4 needs model.lora_rank"):
        build_config(None, {"model.base_quantization": "nf4", "model.lora_rank": 0})
    with pytest.raises(ConfigError, match=r"cannot be sharded with parallel.mode: fsdp"):
        build_config(None, {"model.base_quantization": "int8", "parallel.mode": "fsdp"})
    with pytest.raises(ConfigError, match=r"must be one of none, nf4, int8; got 'fp4'"):
        build_config(None, {"model.base_quantization": "fp4"})
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else found(name, *a))
    with pytest.raises(ConfigError, match=r"needs bitsandbytes: pip install bitsandbytes") as err:
        build_config(None, {"model.base_quantization": "nf4"})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("kind", "shape"), [("nf4", (96, 64)), ("nf4", (300, 70)),
                                             ("int8", (96, 64)), ("int8", (30, 70))])
def test_layer_bytes_equal_what_bitsandbytes_holds(kind, shape):
    linear = torch.nn.Linear(shape[1], shape[0], bias=False)
    layer = quantize_linear(linear, kind, torch.float32, "cpu")
    if kind == "nf4":
        state = layer.weight.quant_state
        tensors = [layer.weight.data, state.absmax, state.code, state.state2.absmax,
                   state.state2.code, state.offset]
        want = nf4_layer_bytes(shape[0] * shape[1])
    else:
        tensors = [layer.weight.data, layer.weight.SCB]
        want = int8_layer_bytes(shape[0] * shape[1], shape[0])
    assert sum(t.numel() * t.element_size() for t in tensors) == want


def test_plan_of_a_quantized_flux_dev_base():
    layers = quantized_layers("black-forest-labs/FLUX.1-dev")
    # FLUX.1-dev: 11.90B parameters, all but the root's and the biases in the blocks' linears
    assert layers.weights + layers.biases + layers.rest == 11_901_408_320
    # the largest: a double block's AdaLN-Zero projection
    assert 11.8e9 < layers.weights < 11.9e9 and layers.largest == 18432 * 3072
    nf4 = quantized_base_bytes(layers, "nf4", 2)
    int8 = quantized_base_bytes(layers, "int8", 2)
    # NF4 with double quantization: 0.5 + 1/64 + 4/(64 x 256) B/param; int8 1 B + row scales
    per_param = 0.5 + 1 / 64 + 4 / (64 * 256)
    rest = 2 * (layers.biases + layers.rest)
    assert nf4 - rest == pytest.approx(per_param * layers.weights, rel=1e-4)
    rows = sum(o for o, _ in layers.shapes)
    assert int8 - rest == layers.weights + 4 * rows
    cfg = build_config("configs/flux_dev_1gpu_24gb.yaml", {})
    plan = plan_for_config(cfg, 1, 24 * GB)
    assert plan.fits and all(p.gpu_bytes <= 24 * GB for p in plan.phases)
    row = {r.part: r.gpu_bytes for r in plan.rows}
    assert row["frozen weights (nf4 base)"] == nf4
    assert row["dequantized weight in flight"] == 2 * layers.largest
    train = dict(plan.phase("train").gpu_parts)
    assert train["dequantized weight"] == 2 * layers.largest
    # int8 and no quantization change the frozen weights only by their bytes
    s = settings_from_config(cfg, 1, "cuda")
    for kind, frozen in (("int8", int8), ("none", 2 * 11_901_408_320)):
        other = build_plan(dataclasses.replace(s, base_quantization=kind), 24 * GB)
        rows = {r.part: r.gpu_bytes for r in other.rows}
        assert rows[f"frozen weights ({kind + ' base' if kind != 'none' else 'bf16'})"] == frozen
    plan80 = plan_for_config(build_config("configs/flux_dev_1gpu_80gb.yaml", {}), 1, 80 * GB)
    assert plan80.fits and not plan_for_config(cfg, 1, 16 * GB).fits
