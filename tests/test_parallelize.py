"""FSDP2 and DDP on 2 CPU ranks (gloo) train a tiny FLUX transformer exactly like one process.

Each run: 3 optimizer steps of a global batch of 8 rows, on 2 ranks as 2 micro-batches of 2 rows
per rank (gradient sync only on the second), on 1 process as 4 micro-batches of 2 rows; AdamW and
global grad-norm clipping (the max norm is small enough to clip every step). The parameters and
the norms must agree to float reduction order: fp32 compute, atol 2e-6 on weights of order 0.1
(measured differences are about 1e-7). All 2-rank scenarios share one spawn (one process group)
to keep start-up cost low.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig
from spawn_ranks import run_ranks

from chunk_grpo.parallelize import (
    ParallelismError,
    any_rank,
    clip_grad_norm,
    parallelize_transformer,
    sync_gradients,
    trainable_parameters,
    unwrapped,
)

TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
# FLUX.1-dev's transformer/config.json with reduced width and depth: its block structure,
# 64 input channels, guidance embedding and CLIP's 768 pooled width; heads 24 -> 2, head width
# 128 -> 16 (rope axes 16/56/56 -> 4/6/6), T5 width 4096 -> 64, 19/38 blocks -> 1/1.
FLUX_DEV_REDUCED = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=1,
                        num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                        joint_attention_dim=64, pooled_projection_dim=768, guidance_embeds=True,
                        axes_dims_rope=(4, 6, 6))
ATTENTION_TEXT = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                  "to_add_out"]
GLOBAL_ROWS, MICRO_ROWS, STEPS, LR, MAX_NORM = 8, 2, 3, 1e-2, 0.01
TOKENS, TEXT_TOKENS = 16, 8


def build_transformer(lora: bool, sizes: dict = TINY, seed: int = 0) -> FluxTransformer2DModel:
    """The same random weights on every rank (FSDP shards each rank's own copy)."""
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**sizes)
    if lora:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=ATTENTION_TEXT,
                                     init_lora_weights="gaussian"))
        with torch.no_grad():  # non-zero B, so every adapter weight has a gradient at once
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def step_batch(step: int, sizes: dict = TINY) -> dict:
    """The global batch of optimizer step ``step``: inputs and a regression target."""
    g = torch.Generator().manual_seed(1000 + step)
    n = GLOBAL_ROWS
    batch = dict(
        hidden_states=torch.randn(n, TOKENS, sizes["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(n, TEXT_TOKENS, sizes["joint_attention_dim"],
                                          generator=g),
        pooled_projections=torch.randn(n, sizes["pooled_projection_dim"], generator=g),
        timestep=torch.rand(n, generator=g),
        target=torch.randn(n, TOKENS, sizes["in_channels"], generator=g),
    )
    if sizes.get("guidance_embeds"):
        batch["guidance"] = torch.full((n,), 3.5)
    return batch


def loss_of(call, batch: dict, rows: slice) -> torch.Tensor:
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                     indexing="ij"), -1).reshape(TOKENS, 3)
    inputs = {k: v[rows] for k, v in batch.items() if k != "target"}
    out = call(**inputs, img_ids=ids, txt_ids=torch.zeros(TEXT_TOKENS, 3), return_dict=False)[0]
    return (out.float() - batch["target"][rows]).pow(2).mean()


def train(call, params: list, rank: int, world: int, sizes: dict = TINY) -> list[float]:
    """STEPS optimizer steps; each rank takes its micro-batches of the global batch. Returns the
    clipped norms."""
    micro = GLOBAL_ROWS // (world * MICRO_ROWS)
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    norms = []
    for step in range(STEPS):
        batch = step_batch(step, sizes)
        for k in range(micro):
            start = (k * world + rank) * MICRO_ROWS
            with sync_gradients(call, enabled=k == micro - 1):
                (loss_of(call, batch, slice(start, start + MICRO_ROWS)) / micro).backward()
        norm = clip_grad_norm(params, MAX_NORM)
        if not any_rank(not torch.isfinite(torch.tensor(norm)).item()):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        norms.append(norm)
    return norms


def full_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable weight as a full CPU tensor (gathered from the shards under FSDP)."""
    state = {}
    for name, p in unwrapped(model).named_parameters():
        if p.requires_grad:
            value = p.full_tensor() if hasattr(p, "full_tensor") else p
            state[name] = value.detach().cpu().clone()
    return state


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
            call = parallelize_transformer(model, mode=mode, device="cpu", param_dtype=None)
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
    results["flux_dev"] = dict(loss=float(loss.detach()), norm=clip_grad_norm(params, 1e9),
                               grads=sum(p.grad is not None for p in params), params=len(params))
    return results


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
    assert runs[0]["norm"] == runs[1]["norm"]  # global: the same number on both ranks
    assert runs[0]["loss"] != runs[1]["loss"]  # each rank had its own rows


def test_none_refuses_several_ranks_and_offload_needs_fsdp(monkeypatch):
    model = build_transformer(False)
    monkeypatch.setattr("chunk_grpo.parallelize.world_size", lambda: 2)
    with pytest.raises(ParallelismError, match="parallelism: ddp .* or fsdp"):
        parallelize_transformer(model, mode="none", device="cpu")
    with pytest.raises(ParallelismError, match="cpu_offload needs parallelism: fsdp"):
        parallelize_transformer(model, mode="ddp", device="cpu", cpu_offload=True)
    with pytest.raises(ParallelismError, match="must be one of fsdp, ddp, none"):
        parallelize_transformer(model, mode="zero3", device="cpu")


def test_one_process_is_left_unwrapped_and_clips_like_torch():
    model = build_transformer(True)
    assert parallelize_transformer(model, mode="fsdp", device="cpu") is model
    params = trainable_parameters(model)
    loss_of(model, step_batch(0), slice(0, 2)).backward()
    copies = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 1e-3)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in copies]))
    assert norm == pytest.approx(float(expected), rel=1e-6)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-4)
    assert any_rank(True) and not any_rank(False)


def test_not_a_flux_transformer_is_named():
    with pytest.raises(ParallelismError, match="expects a FLUX transformer"):
        parallelize_transformer(torch.nn.Linear(2, 2), mode="none", device="cpu")
