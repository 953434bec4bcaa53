"""Sharded loading and sharded accumulation under FSDP2, on 2 CPU ranks (gloo).

Loading (`chunk_grpo.models.sharded_load` through `trainer_setup.build_policy`): the transformer is
built on the meta device, sharded, then each rank reads only its rows of the checkpoint. The
weights it ends with (each DTensor's full tensor) are exactly those of the plain whole-model
load, for full fine-tuning and LoRA (the adapters seeded alike); the full-fine-tuning hybrid base
is sharded too; `fully_shard` only ever sees meta parameters and no rank reads more than its
rows of any tensor. A FLUX.1-dev-width transformer (the real config at 1 + 1 blocks) saved in
bf16 over several safetensors files (the diffusers index) loads the same way.

Accumulation: FSDP2 reduce-scatters every micro-batch, so after a micro-batch each rank holds only
its gradient shards; 4 micro-batches per rank train exactly what one process trains with 8.
All 2-rank scenarios share one launch (one process group) to keep start-up cost low.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from parallel_utils import build_transformer, full_trainable_state, loss_of, step_batch, train
from safetensors import safe_open
from spawn_ranks import run_ranks
from torch.distributed.tensor import DTensor
from trainer_utils import Brightness, registered_rewards, tiny_config

import chunk_grpo.models.sharded_load as sharded_load
import chunk_grpo.runtime.parallelize as parallelize
from chunk_grpo.models.hybrid_base import FrozenTransformerBase
from chunk_grpo.models.loading import ModelLoadError
from chunk_grpo.models.policy_setup import prepare_transformer
from chunk_grpo.plan.models import resolve_model_configs
from chunk_grpo.runtime import distributed as D
from chunk_grpo.runtime.parallelize import (
    parallelize_transformer,
    sync_gradients,
    trainable_parameters,
)
from chunk_grpo.train.setup import build_policy

# one launch of 2 forked ranks; tiny_config's default reward registered for each test
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("brightness_reward")]
SETTINGS = {"parallel.mode": "fsdp", "eval.hybrid_steps": 2,
            "model.lora_targets": ["to_q", "to_k"]}
# FLUX.1-dev's transformer/config.json at 1 double + 1 single block (545M parameters), as the
# memory plan's benchmark builds it.
FLUX_WIDTH_BLOCKS = dict(num_layers=1, num_single_layers=1)


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


@contextmanager
def _watched_loading(log: dict):
    """Record what sharded loading does: whether any parameter reached `fully_shard` off the
    meta device, and how many rows of each tensor were read (a whole-tensor read fails)."""
    original_shard, original_open = parallelize.fully_shard, sharded_load.safe_open

    def fully_shard(module, **kwargs):
        log["sharded"] += 1
        log["not_meta"] += sum(not p.is_meta for p in module.parameters())
        return original_shard(module, **kwargs)

    class Watched:
        def __init__(self, path, framework):
            self.handle = original_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            raise AssertionError(f"the whole of {name} was read")

        def get_slice(self, name):
            stored = self.inner.get_slice(name)

            class Rows:
                def get_shape(self):
                    return stored.get_shape()

                def __getitem__(self, rows):
                    out = stored[rows]
                    log["rows"][name] = log["rows"].get(name, 0) + (out.shape[0] if out.ndim
                                                                     else 1)
                    return out
            return Rows()

    parallelize.fully_shard, sharded_load.safe_open = fully_shard, Watched
    try:
        yield
    finally:
        parallelize.fully_shard, sharded_load.safe_open = original_shard, original_open


def _load(model_dir: Path, out: Path, lora_rank: int) -> dict:
    """build_policy on this rank: every weight in full, the hybrid base's layout, what loading
    read."""
    cfg = tiny_config(model_dir, out, {"model.lora_rank": lora_rank, **SETTINGS})
    log = {"sharded": 0, "not_meta": 0, "rows": {}}
    with _watched_loading(log):
        setup = build_policy(cfg, D.init_distributed("cpu"))
    transformer = setup.policy.transformer
    result = dict(weights={n: _full(p) for n, p in transformer.named_parameters()},
                  dtensors=all(isinstance(p, DTensor) for p in transformer.parameters()),
                  log=log, base=type(setup.base).__name__)
    if isinstance(setup.base, FrozenTransformerBase):
        params = list(setup.base.base_transformer.parameters())
        result["base_layout"] = dict(
            dtensors=all(isinstance(p, DTensor) for p in params),
            local=sum(p.to_local().numel() for p in params), total=sum(p.numel() for p in params),
            dtypes={p.dtype for p in params}, requires_grad=any(p.requires_grad for p in params),
            weights={n: _full(p) for n, p in setup.base.base_transformer.named_parameters()})
    return result


def _flux_width(model_dir: Path) -> dict:
    """The FLUX.1-dev-width transformer loaded sharded in fp32 (full fine-tuning): per tensor,
    whether its full tensor equals the bf16 checkpoint's values cast, without one full copy."""
    transformer = sharded_load.meta_transformer(model_dir, torch.float32)
    prepare_transformer(transformer, lora_rank=0, lora_alpha=None, lora_targets=[],
                        gradient_checkpointing=True, attention_backend="native")
    parallelize_transformer(transformer, mode="fsdp", device="cpu")
    sharded_load.fill_from_checkpoint(transformer, model_dir, device="cpu", lora_seed=0)
    files = sharded_load.transformer_weight_files(model_dir)
    same, local, total = {}, 0, 0
    for name, param in transformer.named_parameters():
        with safe_open(files[name], framework="pt") as handle:
            same[name] = bool(torch.equal(param.full_tensor(), handle.get_tensor(name).float()))
        local, total = local + param.to_local().numel(), total + param.numel()
    return dict(same=same, local=local, total=total, files=len(set(files.values())))


def _accumulation(rank: int, world: int) -> dict:
    """Full fine-tuning under FSDP, 4 micro-batches of 1 row per rank and optimizer step: the
    gradient bytes each rank holds after its first micro-batch, and the trained weights."""
    model = build_transformer(False)
    call = parallelize_transformer(model, mode="fsdp", device="cpu", param_dtype=None)
    params = trainable_parameters(call)
    with sync_gradients(call, enabled=False):  # a micro-batch before the last of a step
        loss_of(call, step_batch(0), slice(rank, rank + 1)).backward()
    held = sum(p.grad.to_local().numel() * p.grad.element_size() for p in params)
    full = sum(p.numel() * p.element_size() for p in params)
    grad_types = {type(p.grad).__name__ for p in params}
    for p in params:
        p.grad = None
    norms = train(call, params, rank, world, micro_rows=1)
    return dict(held=held, full=full, grad_types=grad_types, norms=norms,
                state=full_trainable_state(call))


def sharded_scenarios(rank: int, world: int, tmp: Path, model_dir: Path, flux_dir: Path) -> dict:
    results = {lora: _load(model_dir, tmp / f"run-{lora}", lora) for lora in (0, 4)}
    results["flux_width"] = _flux_width(flux_dir)
    results["accumulation"] = _accumulation(rank, world)
    return results


def save_flux_width(directory: Path) -> Path:
    """The FLUX.1-dev-width transformer with random bf16 weights (FLUX.1-dev's own dtype),
    saved over several safetensors files with the diffusers index, as FLUX.1-dev ships."""
    config = {**resolve_model_configs("black-forest-labs/FLUX.1-dev").transformer,
              **FLUX_WIDTH_BLOCKS}
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(
            {k: v for k, v in config.items() if not k.startswith("_")})
    model.to(torch.bfloat16).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.save_pretrained(directory / "transformer", max_shard_size="400MB")
    return directory


@pytest.fixture(scope="module")
def two_ranks(tiny_flux, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    model_dir = tiny_flux
    flux_dir = save_flux_width(root / "flux-width")
    with registered_rewards(test_brightness=Brightness):  # the forked ranks inherit it
        return root, model_dir, run_ranks(sharded_scenarios, 2, root, model_dir, flux_dir)


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_sharded_loading_gives_the_weights_of_the_plain_load(two_ranks, lora_rank):
    root, model_dir, ranks = two_ranks
    cfg = tiny_config(model_dir, root / "plain", {"model.lora_rank": lora_rank, **SETTINGS})
    plain = build_policy(cfg, D.DistInfo())  # no process group: the whole model, as before
    expected = {n: p.detach() for n, p in plain.policy.transformer.named_parameters()}
    assert any(".lora_A." in n for n in expected) == (lora_rank > 0)
    for rank, results in enumerate(ranks):
        run = results[lora_rank]
        assert run["dtensors"] and run["log"]["not_meta"] == 0
        assert run["weights"].keys() == expected.keys()
        for name, value in expected.items():
            assert run["weights"][name].dtype == value.dtype, name
            torch.testing.assert_close(run["weights"][name], value, atol=0, rtol=0,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        # Each rank read its own rows of each checkpoint tensor (FSDP2's torch.chunk cut of
        # dim 0), never a whole tensor (the watched get_tensor raises).
        for name, value in expected.items():
            if ".lora_" in name:
                continue
            per_rank = -(-value.shape[0] // 2)
            start = min(rank * per_rank, value.shape[0])
            rows = min(per_rank, value.shape[0] - start)
            assert run["log"]["rows"].get(name.replace(".base_layer.", "."), 0) == rows, name
        # policy blocks + root, and under full fine-tuning the hybrid base's the same
        blocks = 2 + 1
        assert run["log"]["sharded"] == blocks * (2 if lora_rank == 0 else 1)


def test_the_full_fine_tuning_hybrid_base_is_sharded(two_ranks):
    _, _, ranks = two_ranks
    plain_policy = {n: w for n, w in ranks[0][0]["weights"].items()}
    for results in ranks:
        assert results[4]["base"] == "AdaptersDisabled"  # LoRA: no copy
        layout = results[0]["base_layout"]
        assert layout["dtensors"] and not layout["requires_grad"]
        assert layout["local"] == pytest.approx(layout["total"] / 2, rel=0.02)
        assert layout["dtypes"] == {torch.float32}  # weights_dtype auto on the CPU
        for name, value in layout["weights"].items():
            assert torch.equal(value, plain_policy[name]), name


def test_a_flux_dev_width_checkpoint_in_several_files_loads_sharded(two_ranks):
    _, _, ranks = two_ranks
    for results in ranks:
        run = results["flux_width"]
        assert run["files"] > 1  # the index json was followed
        assert run["same"] and all(run["same"].values())
        assert run["local"] == pytest.approx(run["total"] / 2, rel=0.01)


def test_fsdp_accumulates_sharded_gradients_that_train_like_one_process(two_ranks):
    """After a micro-batch before the last, each rank holds its shard of the gradients only
    (reduce-scattered, not kept unsharded); 3 optimizer steps of 4 micro-batches per rank give
    one process's weights for the same global batch in 8 micro-batches."""
    _, _, ranks = two_ranks
    reference = build_transformer(False)
    expected_norms = train(reference, trainable_parameters(reference), 0, 1, micro_rows=1)
    expected = full_trainable_state(reference)
    for results in ranks:
        run = results["accumulation"]
        assert run["grad_types"] == {"DTensor"}
        assert run["held"] == pytest.approx(run["full"] / 2, rel=0.02)
        assert run["norms"] == pytest.approx(expected_norms, rel=1e-5)
        for name, value in expected.items():
            torch.testing.assert_close(run["state"][name], value, atol=2e-6, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_a_checkpoint_that_disagrees_with_its_config_is_named(tiny_flux_copy, tmp_path):
    model_dir = tiny_flux_copy  # its weights file is moved away below
    transformer = sharded_load.meta_transformer(model_dir, torch.float32)
    transformer.extra = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ModelLoadError, match=r"extra.weight is not in its checkpoint"):
        sharded_load.fill_from_checkpoint(transformer, model_dir, device="cpu", lora_seed=0)
    (model_dir / "transformer" / sharded_load.WEIGHTS).rename(tmp_path / "moved")
    with pytest.raises(ModelLoadError, match="has neither diffusion_pytorch_model.safetensors"):
        sharded_load.transformer_weight_files(model_dir)


def _one_rank_run(rank: int, world: int, tmp: Path, model_dir: Path, max_steps: int,
                  resume: bool) -> dict:
    """The trainer under FSDP2 on a 1-rank group (as on one GPU): it checkpoints, resumes and
    exports the sharded way (its state is DTensors even with one rank)."""
    from chunk_grpo.train.loop import run

    cfg = tiny_config(model_dir, tmp / "run", {"parallel.mode": "fsdp", "run.max_steps": max_steps,
                                               "run.checkpoint_every": 1})
    run_dir = run(cfg, resume=resume)
    return {"checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
            "exported": (run_dir / "final_model" / "model_index.json").is_file()}


def test_fsdp_on_one_rank_checkpoints_resumes_and_exports(tiny_flux, tmp_path):
    model_dir = tiny_flux
    (first,) = run_ranks(_one_rank_run, 1, tmp_path, model_dir, 1, False)
    assert first["exported"] and first["checkpoints"]
    (second,) = run_ranks(_one_rank_run, 1, tmp_path, model_dir, 2, True)
    assert second["exported"] and len(second["checkpoints"]) >= 1
    assert second["checkpoints"] != first["checkpoints"]  # step 2 was trained and saved


def _roots_after_sampling(rank: int, world: int, tmp: Path, model_dir: Path) -> dict:
    """FSDP2 leaves a root's parameters unsharded after a forward (it expects a backward);
    hybrid sampling with the policy and its sharded base reshards both roots it used."""
    from chunk_grpo.algorithm.rollout import generate

    cfg = tiny_config(model_dir, tmp / "run", {"parallel.mode": "fsdp", "eval.hybrid_steps": 2})
    setup = build_policy(cfg, D.init_for_config(cfg))
    policy, base = setup.policy, setup.base.base_transformer

    def sharded(module) -> bool:  # the root's own weights (the embedders): DTensors or not
        return isinstance(module.x_embedder.weight, DTensor)

    state = {"before": (sharded(policy.transformer), sharded(base))}
    embeds = policy.encode_prompts(["a red circle"])
    with torch.no_grad():  # a bare forward: FSDP2 keeps the root unsharded
        policy.velocity(policy.initial_noise(1, torch.Generator().manual_seed(0)), 0.5, embeds)
    state["bare forward"] = sharded(policy.transformer)
    generate(policy, ["a red circle", "a blue square"], num_steps=4, hybrid_base=setup.base,
             hybrid_steps=2)
    state["after sampling"] = (sharded(policy.transformer), sharded(base))
    return state


def test_sampling_leaves_no_fsdp_root_unsharded(tiny_flux, tmp_path):
    (state,) = run_ranks(_roots_after_sampling, 1, tmp_path, tiny_flux)
    assert state["before"] == (True, True)
    assert state["bare forward"] is False  # what sampling must undo
    assert state["after sampling"] == (True, True)
