"""FSDP2 and DDP on 2 CPU ranks (gloo) train a tiny FLUX transformer exactly like one process.

Each run: 3 optimizer steps of a global batch of 8 rows, on 2 ranks as 2 micro-batches of 2 rows
per rank (gradient sync only on the second), on 1 process as 4 micro-batches of 2 rows; AdamW and
global grad-norm clipping (the max norm is small enough to clip every step). The parameters and
the norms must agree to float reduction order: fp32 compute, atol 2e-6 on weights of order 0.1
(measured differences are about 1e-7). All 2-rank scenarios share one launch (one process group)
to keep start-up cost low.
"""

from __future__ import annotations

import pytest
import torch
from parallel_utils import (
    FLUX_DEV_REDUCED,
    MAX_NORM,
    build_transformer,
    full_trainable_state,
    loss_of,
    step_batch,
    train,
)
from spawn_ranks import run_ranks
from trainer_utils import TINY_DEFAULTS, TINY_SIZES

from chunk_grpo.models.policy import FluxPolicy
from chunk_grpo.models.policy_setup import prepare_transformer
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.runtime.parallelize import (
    ParallelismError,
    all_finite,
    any_rank,
    clip_grad_norm,
    parallelize_transformer,
    trainable_parameters,
    unwrapped,
)


def reference_run(lora: bool) -> tuple[dict, list[float]]:
    """One process, no wrapper: the same global batch as 4 micro-batches of 2 rows."""
    model = build_transformer(lora)
    norms = train(model, trainable_parameters(model), 0, 1)
    return full_trainable_state(model), norms


def parallel_scenarios(rank: int, world: int, tmp, _unused=None) -> dict:
    """Every 2-rank scenario in one process group; returns states and norms per scenario."""
    results = {}
    for mode in ("fsdp", "ddp"):
        for lora in (True, False):
            model = build_transformer(lora)
            # FSDP with per-block activation checkpointing: the recomputation must not change
            # the numbers either.
            call = parallelize_transformer(model, mode=mode, device="cpu", param_dtype=None,
                                           activation_checkpointing=mode == "fsdp")
            norms = train(call, trainable_parameters(call), rank, world)
            results[(mode, lora)] = (full_trainable_state(call), norms)
    # bf16 compute with fp32 master weights and fp32 reduction: it runs and the weights move.
    model = build_transformer(True)
    before = full_trainable_state(model)
    call = parallelize_transformer(model, mode="fsdp", device="cpu", param_dtype=torch.bfloat16)
    norms = train(call, trainable_parameters(call), rank, world)
    results["bf16"] = dict(norms=norms, before=before, after=full_trainable_state(call),
                           dtypes={p.dtype for p in trainable_parameters(call)})
    # FLUX.1-dev's block structure at reduced width: LoRA on both attention streams, per-block
    # activation checkpointing, sharded, one forward + backward.
    model = build_transformer(True, FLUX_DEV_REDUCED)
    call = parallelize_transformer(model, mode="fsdp", device="cpu", param_dtype=None,
                                   activation_checkpointing=True)
    params = trainable_parameters(call)
    loss = loss_of(call, step_batch(0, FLUX_DEV_REDUCED), slice(rank * 4, rank * 4 + 4))
    loss.backward()
    results["flux_dev"] = dict(loss=float(loss.detach()), norm=float(clip_grad_norm(params, 1e9)),
                               grads=sum(p.grad is not None for p in params), params=len(params),
                               finite=all_finite(params))
    if rank == 1:  # a NaN in one shard of one rank: every rank learns of it
        with torch.no_grad():
            next(p for p in params if p.to_local().numel()).to_local().view(-1)[0] = float("nan")
    results["flux_dev"]["nan_seen"] = not all_finite(params)
    for mode in ("ddp", "fsdp"):
        results[("policy", mode)] = policy_gradients(mode, rank, world)
    return results


def policy_gradients(mode: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    """FluxPolicy set up as the trainer does (prepare_transformer: LoRA), parallelized, calling
    through `forward_module`: the synced gradient of this rank's rows of a 4-row batch."""
    policy = tiny_policy()
    model = policy.transformer
    call = parallelize_transformer(model, mode=mode, device="cpu", param_dtype=None)
    if call is not model:
        policy.forward_module = call  # DDP: calls go through the wrapper
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    policy_loss(policy, rows).backward()
    with torch.no_grad():  # the KL reference path: the base model through the same module
        model.disable_adapters()
        policy_loss(policy, rows)
        model.enable_adapters()
    return full_gradients(call)


def tiny_policy() -> FluxPolicy:
    torch.manual_seed(0)
    pipeline = build_tiny_flux_pipeline(["red", "cat"], **TINY_SIZES)
    policy = FluxPolicy(pipeline, TINY_DEFAULTS)
    prepare_transformer(policy.transformer, lora_rank=4, lora_alpha=None,
                        lora_targets=["to_q", "to_k", "to_v", "to_out.0"],
                        gradient_checkpointing=False, attention_backend="native")
    with torch.no_grad():  # non-zero B: every adapter weight gets a gradient
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return policy


def policy_loss(policy: FluxPolicy, rows: slice) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = policy.initial_noise(4, generator=g)
    sigma = torch.tensor([0.9, 0.7, 0.5, 0.3])
    embeds = policy.encode_prompts(["red cat", "cat", "red", "cat red"])
    v = policy.velocity(x[rows], sigma[rows], embeds.index(list(range(4))[rows]))
    return v.pow(2).mean() * (rows.stop - rows.start) / 4  # the mean over all 4 rows, summed


def full_gradients(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in unwrapped(model).named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()
    return grads


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(parallel_scenarios, 2, tmp_path_factory.mktemp("parallel"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_two_ranks_train_like_one_process(two_ranks, mode, lora):
    expected, expected_norms = reference_run(lora)
    for rank, results in enumerate(two_ranks):
        state, norms = results[(mode, lora)]
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, atol=2e-6, rtol=0,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        # The clipped norm is the global one: the same on each rank as on one process.
        assert norms == pytest.approx(expected_norms, rel=1e-5)
        assert all(n > MAX_NORM for n in norms)  # so clipping acted on every step
    start = build_transformer(lora)
    moved = max((expected[n] - p.detach()).abs().max() for n, p in start.named_parameters()
                if n in expected)
    assert moved > 1e-3  # the runs did train


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_fp32_master_weights(two_ranks):
    for results in two_ranks:
        run = results["bf16"]
        assert run["dtypes"] == {torch.float32}
        assert all(torch.isfinite(torch.tensor(run["norms"])))
        moved = max((run["after"][n] - v).abs().max() for n, v in run["before"].items())
        assert moved > 1e-3
    # bf16 compute is close to, not equal to, the fp32 run.
    _, norms = reference_run(True)
    assert two_ranks[0]["bf16"]["norms"][0] == pytest.approx(norms[0], rel=0.05)


@pytest.mark.slow
def test_flux_dev_structure_runs_forward_backward_sharded(two_ranks):
    runs = [results["flux_dev"] for results in two_ranks]
    for run in runs:
        assert run["grads"] == run["params"] > 0
        assert torch.isfinite(torch.tensor([run["loss"], run["norm"]])).all()
        assert run["finite"] and run["nan_seen"]
    assert runs[0]["norm"] == runs[1]["norm"]  # global: the same number on both ranks
    assert runs[0]["loss"] != runs[1]["loss"]  # each rank had its own rows


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_policy_velocity_through_the_parallel_module(two_ranks, mode):
    """Each rank's gradient, after the (averaged) sync, equals one process's gradient of the
    mean over all 4 rows, divided by the world size (DDP and FSDP average over ranks)."""
    policy = tiny_policy()
    policy_loss(policy, slice(0, 4)).backward()
    expected = full_gradients(policy.transformer)
    assert expected and all("lora_" in name for name in expected)
    for results in two_ranks:
        grads = results[("policy", mode)]
        assert grads.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(grads[name] * 2, value, atol=1e-7, rtol=1e-5)


def test_none_refuses_several_ranks_and_offload_needs_fsdp(monkeypatch):
    model = build_transformer(False)
    monkeypatch.setattr("chunk_grpo.runtime.parallelize.world_size", lambda: 2)
    with pytest.raises(ParallelismError, match="parallelism: ddp .* or fsdp"):
        parallelize_transformer(model, mode="none", device="cpu")
    with pytest.raises(ParallelismError, match="cpu_offload needs parallelism: fsdp"):
        parallelize_transformer(model, mode="ddp", device="cpu", cpu_offload=True)
    with pytest.raises(ParallelismError, match="on the CPU .* set cpu_offload: false"):
        parallelize_transformer(model, mode="fsdp", device="cpu", cpu_offload=True)
    with pytest.raises(ParallelismError, match="must be one of fsdp, ddp, none"):
        parallelize_transformer(model, mode="zero3", device="cpu")


def test_one_process_is_left_unwrapped_and_clips_like_torch():
    model = build_transformer(True)
    assert parallelize_transformer(model, mode="fsdp", device="cpu") is model
    params = trainable_parameters(model)
    loss_of(model, step_batch(0), slice(0, 2)).backward()
    copies = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 1e-3)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0  # on the device: no host read
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in copies]))
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-4)
    assert any_rank(True) and not any_rank(False)
    assert any_rank(torch.tensor(True)) and not any_rank(torch.tensor(False))
    assert all_finite(params)
    with torch.no_grad():
        params[0][0, 0] = float("nan")
    assert not all_finite(params)


def test_not_a_flux_transformer_is_named():
    with pytest.raises(ParallelismError, match="expects a FLUX transformer"):
        parallelize_transformer(torch.nn.Linear(2, 2), mode="none", device="cpu")
