"""chunk_grpo_loss: every backend against the reference and against the textbook special cases."""

import numpy as np
import pytest
import torch

import grpo_kernels as gk

BACKENDS = ["reference", "cpu_fused", "triton"]


def _data(batch=6, steps=9, seed=0, spread=0.05, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logp_old = torch.randn(batch, steps, generator=g)
    logp_new = logp_old + spread * torch.randn(batch, steps, generator=g)
    advantages = torch.randn(batch, generator=g)
    return logp_new.to(dtype), logp_old.to(dtype), advantages.to(dtype)


def _loss_and_grad(logp_new, logp_old, advantages, sizes, backend, **kwargs):
    logp_new = logp_new.detach().requires_grad_()
    loss, stats = gk.chunk_grpo_loss(logp_new, logp_old, advantages, sizes, backend=backend,
                                     **kwargs)
    (grad,) = torch.autograd.grad(loss, logp_new)
    return loss, grad, stats


@pytest.mark.parametrize("backend", ["cpu_fused", "triton"])
@pytest.mark.parametrize(
    "sizes, kwargs",
    [
        ([2, 3, 4], dict(clip_low=0.02, clip_high=0.03)),
        ([1, 1, 7], dict(clip_low=0.02, clip_high=0.02, kl_coef=0.3, adv_clip_max=0.8)),
        ([9], dict(clip_low=0.01, clip_high=0.05)),
    ],
)
def test_matches_reference(backend, sizes, kwargs):
    logp_new, logp_old, advantages = _data()
    mask = torch.rand(6, len(sizes), generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, 0] = True
    ref = _loss_and_grad(logp_new, logp_old, advantages, sizes, "reference", chunk_mask=mask,
                         **kwargs)
    out = _loss_and_grad(logp_new, logp_old, advantages, sizes, backend, chunk_mask=mask,
                         **kwargs)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-7)
    assert out[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(out[2][name], ref[2][name], rtol=1e-5, atol=1e-6,
                                   equal_nan=True, msg=name)


@pytest.mark.parametrize("backend", ["cpu_fused", "triton"])
def test_bf16_logps(backend):
    logp_new, logp_old, advantages = _data(dtype=torch.bfloat16, spread=0.1)
    kwargs = dict(clip_low=0.05, clip_high=0.05, kl_coef=0.1)
    ref = _loss_and_grad(logp_new, logp_old, advantages, [4, 5], "reference", **kwargs)
    out = _loss_and_grad(logp_new, logp_old, advantages, [4, 5], backend, **kwargs)
    assert out[1].dtype == torch.bfloat16 and out[0].dtype == torch.float32
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1].float(), ref[1].float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_sizes_of_one_equal_per_step_ppo_clip(backend):
    logp_new, logp_old, advantages = _data(spread=0.2)
    lo, hi = 0.1, 0.15
    loss, grad, _ = _loss_and_grad(logp_new, logp_old, advantages, [1] * 9, backend,
                                   clip_low=lo, clip_high=hi)
    # Per-step GRPO (Dance-GRPO): mean over (sample, step) of the PPO-clip objective.
    new = logp_new.clone().requires_grad_()
    ratio = torch.exp(new - logp_old)
    a = advantages[:, None]
    want = torch.maximum(-a * ratio, -a * ratio.clamp(1 - lo, 1 + hi)).mean()
    (want_grad,) = torch.autograd.grad(want, new)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_chunk_equals_sequence_level_loss(backend):
    logp_new, logp_old, advantages = _data(spread=0.03)
    loss, grad, stats = _loss_and_grad(logp_new, logp_old, advantages, [9], backend,
                                       clip_low=0.01, clip_high=0.01)
    # GSPO-style: one ratio per sample, the geometric mean of its step ratios.
    new = logp_new.clone().requires_grad_()
    ratio = torch.exp((new - logp_old).mean(dim=1))
    want = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.99, 1.01)).mean()
    (want_grad,) = torch.autograd.grad(want, new)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)
    clipped = ((ratio < 0.99) | (ratio > 1.01)).float().mean()
    torch.testing.assert_close(stats["clip_frac"], clipped)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unmoved_policy_gives_ratio_exactly_one(backend):
    _, logp_old, advantages = _data(seed=3)
    logp_new = logp_old.clone()
    sizes = [2, 3, 4]
    loss, grad, stats = _loss_and_grad(logp_new, logp_old, advantages, sizes, backend,
                                       clip_low=1e-4, clip_high=1e-4, kl_coef=0.5)
    assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["clip_frac"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    assert loss.item() == pytest.approx(-advantages.mean().item(), rel=1e-6)
    # A tiny clip range must not zero the gradient: d/d logp_t = -A / (B K size_j).
    size_of_step = torch.tensor([2, 2, 3, 3, 3, 4, 4, 4, 4], dtype=torch.float32)
    want = -advantages[:, None] / (6 * 3 * size_of_step)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["cpu_fused", "reference"])
def test_gradcheck_float64(backend):
    logp_new, logp_old, advantages = _data(batch=3, steps=5, spread=0.3, dtype=torch.float64)
    mask = torch.tensor([[True, False], [True, True], [False, True]])

    def fn(new):
        return gk.chunk_grpo_loss(new, logp_old, advantages, [2, 3], chunk_mask=mask,
                                  clip_low=0.05, clip_high=0.08, kl_coef=0.2,
                                  backend=backend)[0]

    assert torch.autograd.gradcheck(fn, (logp_new.requires_grad_(),))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_chunk_stats(backend):
    delta = torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, -0.5]])
    logp_old = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    _, stats = gk.chunk_grpo_loss(logp_old + delta, logp_old, torch.ones(2), [1, 1, 1],
                                  chunk_mask=mask, clip_low=0.2, clip_high=0.2, backend=backend)
    assert stats["trained_per_chunk"].tolist() == [2, 1, 0]
    assert stats["clip_frac_per_chunk"][:2].tolist() == [0.0, 0.0]
    assert stats["clip_frac_per_chunk"][2].isnan()  # no sample trains chunk 2
    ratio = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    torch.testing.assert_close(stats["ratio_mean_per_chunk"][:2], ratio[0])
    # Untrained pairs never count: chunk 2's ratios (e^0.5, e^-0.5) are clipped but masked.
    assert stats["clip_frac"].item() == 0.0
    _, stats = gk.chunk_grpo_loss(logp_old + delta, logp_old, torch.ones(2), [1, 1, 1],
                                  clip_low=0.2, clip_high=0.2, backend=backend)
    assert stats["clip_frac_per_chunk"].tolist() == [0.0, 0.0, 1.0]
    assert stats["clip_frac"].item() == pytest.approx(2 / 6)


def test_module_wrapper_matches_functional():
    logp_new, logp_old, advantages = _data()
    module = gk.ChunkGrpoLoss([4, 5], clip_low=0.1, clip_high=0.2, kl_coef=0.1)
    got, _ = module(logp_new, logp_old, advantages)
    want, _ = gk.chunk_grpo_loss(logp_new, logp_old, advantages, [4, 5], clip_low=0.1,
                                 clip_high=0.2, kl_coef=0.1)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(chunk_sizes=[2, 3]), "sum to 5 but logp_new has S=9"),
        (dict(chunk_sizes=[0, 9]), "chunk_sizes must all be >= 1"),
        (dict(chunk_sizes=[-1, 10]), "chunk_sizes must all be >= 1"),
        (dict(chunk_sizes=[]), "chunk_sizes must be a non-empty"),
        (dict(chunk_sizes=[4.5, 4.5]), "chunk_sizes must be a non-empty sequence of ints"),
        (dict(chunk_mask=torch.ones(6, 3, dtype=torch.bool)), r"chunk_mask must have shape"),
        (dict(chunk_mask=torch.ones(6, 2)), "chunk_mask must be a bool tensor"),
        (dict(chunk_mask=torch.zeros(6, 2, dtype=torch.bool)), "chunk_mask selects no chunk"),
        (dict(logp_old=torch.zeros(6, 8)), "logp_old has shape"),
        (dict(logp_new=torch.zeros(6, 9, dtype=torch.int32)), "logp_new must have a floating"),
        (dict(logp_new=torch.zeros(9)), r"logp_new must be \[B, S\]"),
        (dict(advantages=torch.zeros(6, 1)), "advantages must have shape"),
        (dict(advantages=torch.zeros(6, device="meta")), "advantages is on meta"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(adv_clip_max=0.0), "adv_clip_max"),
        (dict(backend="fused"), "backend must be"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(overrides, match):
    logp_new, logp_old, advantages = _data()
    kwargs = dict(logp_new=logp_new, logp_old=logp_old, advantages=advantages,
                  chunk_sizes=[4, 5], clip_low=0.1, clip_high=0.1)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=match):
        gk.chunk_grpo_loss(**kwargs)


def test_nan_rejected_when_checking():
    logp_new, logp_old, advantages = _data()
    logp_old[2, 3] = float("nan")
    with pytest.raises(ValueError, match="logp_old contains NaN"):
        gk.chunk_grpo_loss(logp_new, logp_old, advantages, [4, 5], clip_low=0.1,
                           clip_high=0.1, check=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_raises_a_clear_error(backend):
    empty = torch.zeros(0, 9)
    with pytest.raises(ValueError, match=r"no samples \(B = 0\)"):
        gk.chunk_grpo_loss(empty, empty, torch.zeros(0), [4, 5], clip_low=0.1, clip_high=0.1,
                           backend=backend)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("kl_coef", float("nan"), r"kl_coef must be a finite number in \[0.0, any"),
        ("kl_coef", -0.1, "kl_coef must be a finite number"),
        ("kl_coef", float("inf"), "kl_coef must be a finite number"),
        ("kl_coef", "0.1", "kl_coef must be a real number, got str"),
        ("clip_low", float("nan"), r"clip_low must be a finite number in \[0.0, 1.0\)"),
        ("clip_low", -0.1, "clip_low must be a finite number"),
        ("clip_high", float("inf"), "clip_high must be a finite number"),
        ("clip_high", float("nan"), "clip_high must be a finite number"),
        ("clip_high", True, "clip_high must be a real number, got bool"),
        ("adv_clip_max", float("inf"), "adv_clip_max .*; use None for no clipping"),
        ("adv_clip_max", float("nan"), "adv_clip_max must be a finite number"),
        ("adv_clip_max", -1.0, "adv_clip_max must be a finite number"),
        ("adv_clip_max", torch.tensor(1.0), "adv_clip_max must be a real number, got Tensor"),
    ],
)
def test_every_loss_number_must_be_finite_and_in_range(name, value, match):
    logp_new, logp_old, advantages = _data()
    kwargs = dict(clip_low=0.1, clip_high=0.1) | {name: value}
    with pytest.raises(ValueError, match=match):
        gk.chunk_grpo_loss(logp_new, logp_old, advantages, [4, 5], **kwargs)
    with pytest.raises(ValueError, match=match):  # the module checks at construction
        gk.ChunkGrpoLoss([4, 5], **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([0],), dict(clip_low=0.1, clip_high=0.1), "chunk_sizes must all be >= 1"),
        (([],), dict(clip_low=0.1, clip_high=0.1), "chunk_sizes must be a non-empty"),
        (([1.5],), dict(clip_low=0.1, clip_high=0.1), "sequence of ints"),
        ((3,), dict(clip_low=0.1, clip_high=0.1), "sequence of ints"),
        (([4, 5],), dict(clip_low=1.0, clip_high=0.1), "clip_low"),
        (([4, 5],), dict(clip_low=0.1, clip_high=0.1, kl_coef=-1.0), "kl_coef"),
        (([4, 5],), dict(clip_low=0.1, clip_high=0.1, backend="fused"), "backend must be"),
    ],
)
def test_module_settings_fail_at_construction(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gk.ChunkGrpoLoss(*args, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_numbers_are_accepted_like_python_numbers(backend):
    logp_new, logp_old, advantages = _data()
    want = gk.chunk_grpo_loss(logp_new, logp_old, advantages, [4, 5], clip_low=0.1,
                              clip_high=0.2, adv_clip_max=1.0, kl_coef=0.05, backend=backend)
    got = gk.chunk_grpo_loss(logp_new, logp_old, advantages, np.array([4, 5]),
                             clip_low=np.float32(0.1), clip_high=np.float64(0.2),
                             adv_clip_max=np.int64(1), kl_coef=np.float32(0.05), backend=backend)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
