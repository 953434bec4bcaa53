"""sde_step_logprob / sde_step_sample / ode_step: every backend against the torch reference."""

import math

import numpy as np
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.functional import resolve_backend

KINDS = ["flow", "dance", "cps", "cps_mse"]
SIGMA_MAX = 0.96


def _inputs(shape, dtype=torch.float32, seed=0):
    """Latents plus per-sample steps, one of them at sigma == 1 (flow's sigma_max case)."""
    g = torch.Generator().manual_seed(seed)
    x, v, e = (torch.randn(shape, generator=g) for _ in range(3))
    batch = shape[0]
    sigma = torch.linspace(1.0, 0.3, batch) if batch > 1 else torch.tensor([0.7])
    sigma_next = sigma - 0.04 - 0.02 * torch.rand(batch, generator=g)
    x_next = x + (sigma_next - sigma).view(-1, *[1] * (len(shape) - 1)) * v + 0.1 * e
    return x.to(dtype), v.to(dtype), x_next.to(dtype), sigma, sigma_next


def _logprob_and_grads(x, v, x_next, sigma, sigma_next, kind, backend, reduction="mean"):
    x, v = x.detach().requires_grad_(), v.detach().requires_grad_()
    logp = gk.sde_step_logprob(
        x, v, x_next, sigma, sigma_next, eta=0.7, kind=kind, sigma_max=SIGMA_MAX,
        reduction=reduction, backend=backend,
    )
    weights = torch.linspace(0.5, 1.5, logp.shape[0], dtype=logp.dtype)  # distinct grad_out
    grad_x, grad_v = torch.autograd.grad((logp * weights).sum(), (x, v))
    return logp, grad_x, grad_v


def _close(actual, expected, rtol):
    """Relative to the tensor's scale: logps can be large (1 / (2 n^2) factors)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, check_dtype=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["cpu_fused", "triton"])
def test_fp32_forward_backward_match_fp64_reference(kind, backend):
    # [3, 5, 37]: N = 185 is no multiple of Inductor's 16 lanes or Triton's 1024 block.
    x, v, x_next, sigma, sigma_next = _inputs((3, 5, 37))
    truth = _logprob_and_grads(
        x.double(), v.double(), x_next.double(), sigma.double(), sigma_next.double(), kind,
        "reference",
    )
    out = _logprob_and_grads(x, v, x_next, sigma, sigma_next, kind, backend)
    ref32 = _logprob_and_grads(x, v, x_next, sigma, sigma_next, kind, "reference")
    for got, ref, want in zip(out, ref32, truth, strict=True):
        assert got.dtype == ref.dtype
        # The fused kernel may not be worse than twice the fp32 reference's own error (+ slack).
        err = (got.double() - want).abs().max().item()
        ref_err = (ref.double() - want).abs().max().item()
        assert err <= 2 * ref_err + 1e-6 * want.abs().max().item(), (err, ref_err)


@pytest.mark.parametrize("backend", ["cpu_fused", "triton"])
@pytest.mark.parametrize("kind", ["flow", "cps"])
def test_bf16_inputs_match_reference(kind, backend):
    x, v, x_next, sigma, sigma_next = _inputs((2, 3, 41), dtype=torch.bfloat16, seed=1)
    ref = _logprob_and_grads(x, v, x_next, sigma, sigma_next, kind, "reference")
    out = _logprob_and_grads(x, v, x_next, sigma, sigma_next, kind, backend)
    assert out[0].dtype == torch.float32 and out[2].dtype == torch.bfloat16
    _close(out[0], ref[0], rtol=1e-5)  # both compute in fp32 from the same bf16 values
    _close(out[1].float(), ref[1].float(), rtol=8e-3)  # one bf16 rounding of the gradient
    _close(out[2].float(), ref[2].float(), rtol=8e-3)


def test_reference_follows_the_design_formulas_literally():
    # Flow-GRPO at sigma == 1 uses sigma_max in the std's denominator, and every kind's mean
    # expands to a x + b v: check the reference against a hand computation on one element.
    x, v, xn = torch.tensor([[0.3]]), torch.tensor([[-1.2]]), torch.tensor([[0.5]])
    s, sn, eta = 1.0, 0.9, 0.5
    std = eta * math.sqrt(s / (1 - SIGMA_MAX))
    dt = sn - s
    mean = 0.3 * (1 + std**2 / (2 * s) * dt) + (-1.2) * (1 + std**2 * (1 - s) / (2 * s)) * dt
    n = std * math.sqrt(-dt)
    want = -((0.5 - mean) ** 2) / (2 * n**2) - math.log(n) - 0.5 * math.log(2 * math.pi)
    for backend in ("reference", "cpu_fused"):
        got = gk.sde_step_logprob(x, v, xn, s, sn, eta=eta, sigma_max=SIGMA_MAX, backend=backend)
        assert got.item() == pytest.approx(want, rel=1e-5)
    # cps_mse: -mean((x' - m)^2) with m = (1-s') x0 + sqrt(s'^2 - n^2) x1.
    s, sn, eta = 0.6, 0.4, 0.7
    n = sn * math.sin(eta * math.pi / 2)
    mean = (1 - sn) * (0.3 - s * -1.2) + math.sqrt(sn**2 - n**2) * (0.3 + (1 - s) * -1.2)
    got = gk.sde_step_logprob(x, v, xn, s, sn, eta=eta, kind="cps_mse", backend="reference")
    assert got.item() == pytest.approx(-((0.5 - mean) ** 2), rel=1e-5)
    # dance: m = x + dt v - 0.5 eta^2 score dt, score = -(x - (1-s) x0) / s^2.
    x0 = 0.3 - s * -1.2
    score = -(0.3 - (1 - s) * x0) / s**2
    mean = 0.3 + (sn - s) * -1.2 + (-0.5 * eta**2 * score) * (sn - s)
    n = eta * math.sqrt(s - sn)
    want = -((0.5 - mean) ** 2) / (2 * n**2) - math.log(n) - 0.5 * math.log(2 * math.pi)
    got = gk.sde_step_logprob(x, v, xn, s, sn, eta=eta, kind="dance", backend="cpu_fused")
    assert got.item() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("backend", ["reference", "cpu_fused"])
def test_sum_reduction_is_numel_times_mean(backend):
    x, v, x_next, sigma, sigma_next = _inputs((2, 4, 9))
    mean = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.5, sigma_max=SIGMA_MAX,
                               backend=backend)
    total = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.5, sigma_max=SIGMA_MAX,
                                reduction="sum", backend=backend)
    torch.testing.assert_close(total, mean * 36, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["cpu_fused", "triton"])
def test_non_contiguous_and_batch_of_one(backend):
    x, v, x_next, sigma, sigma_next = _inputs((3, 6, 10), seed=2)
    # Transposed latents are non-contiguous; every other sample is a strided batch view.
    xs, vs, xns = (t.transpose(1, 2) for t in (x, v, x_next))
    assert not xs.is_contiguous()
    ref = _logprob_and_grads(xs, vs, xns, sigma, sigma_next, "dance", "reference")
    out = _logprob_and_grads(xs, vs, xns, sigma, sigma_next, "dance", backend)
    assert out[2].shape == xs.shape
    for got, want in zip(out, ref, strict=True):
        _close(got, want, rtol=1e-5)
    strided = [t[::2] for t in (x, v, x_next)]
    ref = _logprob_and_grads(*strided, sigma[::2], sigma_next[::2], "flow", "reference")
    out = _logprob_and_grads(*strided, sigma[::2], sigma_next[::2], "flow", backend)
    for got, want in zip(out, ref, strict=True):
        _close(got, want, rtol=1e-5)
    one = [t[1:2] for t in (x, v, x_next)]
    ref = _logprob_and_grads(*one, sigma[1:2], sigma_next[1:2], "cps", "reference")
    out = _logprob_and_grads(*one, sigma[1:2], sigma_next[1:2], "cps", backend)
    assert out[0].shape == (1,)
    for got, want in zip(out, ref, strict=True):
        _close(got, want, rtol=1e-5)


def test_scalar_and_per_sample_steps_agree():
    x, v, x_next, _, _ = _inputs((3, 2, 8))
    # Values exact in fp32, so a Python float and an fp32 tensor carry the same number.
    scalar = gk.sde_step_logprob(x, v, x_next, 0.75, 0.625, eta=0.5, kind="dance")
    tensor = gk.sde_step_logprob(
        x, v, x_next, torch.full((3,), 0.75), torch.tensor(0.625), eta=torch.tensor([0.5] * 3),
        kind="dance",
    )
    torch.testing.assert_close(scalar, tensor, rtol=0, atol=0)


def test_per_sample_steps_equal_separate_calls():
    x, v, x_next, sigma, sigma_next = _inputs((4, 3, 7))
    together = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, sigma_max=SIGMA_MAX)
    for i in range(4):
        alone = gk.sde_step_logprob(x[i : i + 1], v[i : i + 1], x_next[i : i + 1], sigma[i],
                                    sigma_next[i], eta=0.7, sigma_max=SIGMA_MAX)
        torch.testing.assert_close(alone[0], together[i], rtol=1e-6, atol=1e-6)


def test_gradient_reaches_x_next_too():
    x, v, x_next, sigma, sigma_next = _inputs((2, 3, 5))
    grads = []
    for backend in ("reference", "cpu_fused", "triton"):
        xn = x_next.clone().requires_grad_()
        lp = gk.sde_step_logprob(x, v, xn, sigma, sigma_next, eta=0.7, kind="cps",
                                 backend=backend, sigma_max=SIGMA_MAX)
        grads.append(torch.autograd.grad(lp.sum(), xn)[0])
    _close(grads[1], grads[0], rtol=1e-5)
    _close(grads[2], grads[0], rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind):
    x, v, x_next, sigma, sigma_next = _inputs((2, 3, 4), dtype=torch.float64, seed=3)
    x, v, x_next = (t.requires_grad_() for t in (x, v, x_next))
    fn = lambda a, b, c: gk.sde_step_logprob(  # noqa: E731
        a, b, c, sigma.double(), sigma_next.double(), eta=0.8, kind=kind, sigma_max=SIGMA_MAX,
        backend="cpu_fused",
    )
    assert torch.autograd.gradcheck(fn, (x, v, x_next))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "cpu_fused", "triton"])
def test_sample_matches_reference_and_its_logp_is_exact(kind, backend):
    x, v, _, sigma, sigma_next = _inputs((3, 2, 19), seed=4)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    x_ref, _ = gk.sde_step_sample(x, v, noise, sigma, sigma_next, eta=0.7, kind=kind,
                                  sigma_max=SIGMA_MAX, backend="reference")
    x_next, logp = gk.sde_step_sample(x, v, noise, sigma, sigma_next, eta=0.7, kind=kind,
                                      sigma_max=SIGMA_MAX, backend=backend)
    _close(x_next, x_ref, rtol=1e-6)
    again = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, kind=kind,
                                sigma_max=SIGMA_MAX, backend=backend)
    assert torch.equal(logp, again)  # bit-for-bit: the ratio of an unmoved policy is 1.0


@pytest.mark.parametrize("backend", ["cpu_fused", "triton"])
def test_sample_in_bf16_keeps_dtype_and_the_noise_law(backend):
    x, v, _, sigma, sigma_next = _inputs((2, 64, 16), dtype=torch.bfloat16, seed=6)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    x_next, logp = gk.sde_step_sample(x, v, noise, sigma, sigma_next, eta=0.7, kind="dance",
                                      backend=backend)
    assert x_next.dtype == torch.bfloat16 and logp.dtype == torch.float32
    x_ref, logp_ref = gk.sde_step_sample(x, v, noise, sigma, sigma_next, eta=0.7, kind="dance",
                                         backend="reference")
    _close(x_next.float(), x_ref.float(), rtol=8e-3)
    # A true sample's mean log-density is -0.5 E[eps^2] - log n - 0.5 log 2 pi (E[eps^2] ~ 1).
    n = 0.7 * torch.sqrt(sigma - sigma_next)
    expected = -0.5 - torch.log(n) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(logp, expected, rtol=0, atol=0.1)


def test_ode_step():
    x, v, _, sigma, sigma_next = _inputs((3, 4, 5))
    out = gk.ode_step(x, v, sigma, sigma_next)
    torch.testing.assert_close(out, x + (sigma_next - sigma).view(-1, 1, 1) * v)
    last = gk.ode_step(x, v, 0.25, 0.0)  # the final step into sigma = 0 is allowed
    torch.testing.assert_close(last, x - 0.25 * v)
    xb, vb = x.bfloat16().requires_grad_(), v.bfloat16()
    out = gk.ode_step(xb, vb, sigma, sigma_next)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert torch.equal(xb.grad, torch.ones_like(xb))
    with pytest.raises(ValueError, match="sigma_next"):
        gk.ode_step(x, v, 0.5, 0.6)


def test_dispatch_by_device_and_override(monkeypatch):
    assert resolve_backend(None, torch.device("cpu")) == "cpu_fused"
    assert resolve_backend(None, torch.device("cuda")) == "triton"
    assert resolve_backend("reference", torch.device("cuda")) == "reference"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", torch.device("cpu"))


def test_module_wrapper_matches_functional():
    x, v, x_next, sigma, sigma_next = _inputs((2, 3, 6))
    module = gk.SdeStepLogprob(eta=0.7, kind="flow", sigma_max=SIGMA_MAX)
    want = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, sigma_max=SIGMA_MAX)
    assert torch.equal(module(x, v, x_next, sigma, sigma_next), want)
    assert "eta=0.7" in repr(module)


def _call(**overrides):
    x, v, x_next, sigma, sigma_next = _inputs((2, 3, 4))
    kwargs = dict(x=x, v=v, x_next=x_next, sigma=sigma, sigma_next=sigma_next, eta=0.7,
                  kind="dance")
    kwargs.update(overrides)
    return gk.sde_step_logprob(**kwargs)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(v=torch.zeros(2, 3, 5)), "v has shape"),
        (dict(x_next=torch.zeros(3, 3, 4)), "x_next has shape"),
        (dict(x=torch.zeros(2, 3, 4, dtype=torch.int64)), "x must have a floating dtype"),
        (dict(v=torch.zeros(2, 3, 4, device="meta")), "v is on meta"),
        (dict(sigma=torch.tensor([0.5, 0.4], device="meta")), "sigma is on meta"),
        (dict(x=torch.zeros(2)), "x must be a non-empty"),
        (dict(x=[[0.0]]), "x must be a torch.Tensor"),
        (dict(sigma=0.0, sigma_next=0.0), "sigma must lie in"),
        (dict(sigma=1.5), "sigma must lie in"),
        (dict(sigma=0.5, sigma_next=0.5), "sigma_next must satisfy"),
        (dict(sigma=0.5, sigma_next=0.6), "sigma_next must satisfy"),
        (dict(sigma=0.5, sigma_next=-0.1), "sigma_next must satisfy"),
        (dict(sigma=torch.tensor([0.5, 0.4, 0.3])), r"sigma must be a scalar or a tensor"),
        (dict(sigma=torch.tensor([1, 1])), "sigma must have a floating dtype"),
        (dict(eta=0.0), "eta must be"),
        (dict(eta=float("nan")), "eta must be"),
        (dict(kind="ode"), "use ode_step"),
        (dict(kind="sde"), "kind must be one of"),
        (dict(reduction="none"), "reduction must be one of"),
        (dict(backend="gpu"), "backend must be"),
        (dict(kind="flow", sigma=1.0, sigma_next=0.9), "sigma_max is required"),
        (dict(kind="flow", sigma=1.0, sigma_next=0.9, sigma_max=1.0), "sigma_max must lie"),
        (dict(kind="cps", sigma=0.2, sigma_next=0.0), "sigma_next == 0"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(overrides, match):
    with pytest.raises(ValueError, match=match):
        _call(**overrides)


def test_nan_rejected_only_when_checking():
    x, v, x_next, sigma, sigma_next = _inputs((2, 3, 4))
    v[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="v contains NaN"):
        gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, kind="dance", check=True)
    out = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, kind="dance")
    assert out[0].isnan() and not out[1].isnan()  # without check, NaN propagates per sample


def test_sample_bad_input():
    x, v, _, sigma, sigma_next = _inputs((2, 3, 4))
    with pytest.raises(ValueError, match="noise has shape"):
        gk.sde_step_sample(x, v, torch.zeros(2, 3), sigma, sigma_next, eta=0.5, kind="dance")
    with pytest.raises(ValueError, match="eta must be"):
        gk.sde_step_sample(x, v, torch.zeros_like(x), sigma, sigma_next, eta=-1.0, kind="dance")


def test_fused_cpu_is_bit_identical_for_any_thread_count():
    # N = 90000 spans six 16384-element blocks: partial sums are added in block order. 3 x N
    # is above the C code's PARALLEL_MIN, so two threads really split the work.
    x, v, x_next, sigma, sigma_next = _inputs((3, 90000), seed=8)
    threads = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append(_logprob_and_grads(x, v, x_next, sigma, sigma_next, "flow", "cpu_fused"))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*out, strict=True):
        assert torch.equal(one, two)
    ref = _logprob_and_grads(x, v, x_next, sigma, sigma_next, "flow", "reference")
    for got, want in zip(out[0], ref, strict=True):
        _close(got, want, rtol=1e-5)


def test_fp16_and_mixed_dtypes_and_the_eager_fallback(monkeypatch):
    x, v, x_next, sigma, sigma_next = _inputs((2, 3, 21), seed=9)
    ref = _logprob_and_grads(x, v, x_next, sigma, sigma_next, "cps", "reference")
    half = _logprob_and_grads(x.half(), v.half(), x_next.half(), sigma, sigma_next, "cps",
                              "cpu_fused")
    assert half[2].dtype == torch.float16
    _close(half[0], ref[0], rtol=1e-2)
    mixed = _logprob_and_grads(x, v.bfloat16(), x_next, sigma, sigma_next, "cps", "cpu_fused")
    assert mixed[1].dtype == torch.float32 and mixed[2].dtype == torch.bfloat16
    _close(mixed[1], ref[1], rtol=1e-2)
    # Without a C compiler the same formulas run in eager torch.
    from grpo_kernels import cpu_fused

    monkeypatch.setattr(cpu_fused, "library", lambda: None)
    eager = _logprob_and_grads(x, v, x_next, sigma, sigma_next, "cps", "cpu_fused")
    for got, want in zip(eager, ref, strict=True):
        _close(got, want, rtol=1e-5)


def test_kernel_library_builds_into_its_cache_and_warns_without_compiler(monkeypatch, tmp_path):
    from grpo_kernels import cpu_fused

    monkeypatch.setenv("GRPO_KERNELS_CACHE", str(tmp_path))
    lib = cpu_fused.library.__wrapped__()  # uncached: a real build
    assert lib is not None and hasattr(lib, "sde_logprob_fwd_bf16")
    assert len(list(tmp_path.glob("sde_step-*.so"))) == 1
    monkeypatch.setenv("GRPO_KERNELS_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="falling back to eager torch"):
        assert cpu_fused.library.__wrapped__() is None


def test_cached_outputs_never_alias_a_live_result():
    """Large gradients reuse a cached buffer only after the caller has dropped the last one."""
    from grpo_kernels import cpu_fused

    g = torch.Generator().manual_seed(0)
    shape = (3, 300, 300)  # 1.08 MB of fp32: large enough for the cache
    x, v, x_next = (torch.randn(shape, generator=g) for _ in range(3))
    v.requires_grad_(True)

    def grad(scale: float) -> torch.Tensor:
        logp = gk.sde_step_logprob(x, v, x_next, 0.8, 0.7, eta=0.7, backend="cpu_fused")
        return torch.autograd.grad(scale * logp.sum(), v)[0]

    expected = torch.autograd.grad(
        gk.sde_step_logprob(x, v, x_next, 0.8, 0.7, eta=0.7, backend="reference").sum(), v)[0]
    first = grad(1.0)
    second = grad(2.0)  # `first` is alive: a new buffer, and `first` keeps its values
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(second, 2 * expected, rtol=1e-5, atol=1e-8)
    view = first[1:]  # a view alone keeps the buffer in use too
    ptr = first.data_ptr()
    del first
    third = grad(3.0)
    assert third.data_ptr() != ptr
    torch.testing.assert_close(view, expected[1:], rtol=1e-5, atol=1e-8)
    del view, second, third
    cached = {t.data_ptr() for t in cpu_fused.OUTPUTS._tensors.values()}
    assert grad(1.0).data_ptr() in cached  # every earlier result is gone: a buffer is reused
    cpu_fused.OUTPUTS.clear()


def _logp_and_grad_v(x, v, x_next, sigma, sigma_next, **kwargs):
    v = v.detach().clone().requires_grad_()
    logp = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, sigma_max=SIGMA_MAX,
                               **kwargs)
    return logp, torch.autograd.grad(logp.sum(), v)[0]


def test_value_check_cache_hit_equals_miss():
    from grpo_kernels.validation import _check_step_values

    x, v, x_next, sigma, sigma_next = _inputs((3, 4, 5))
    _check_step_values.cache_clear()
    miss = _logp_and_grad_v(x, v, x_next, sigma, sigma_next)
    assert _check_step_values.cache_info().misses == 1
    hit = _logp_and_grad_v(x, v, x_next, sigma.clone(), sigma_next.clone())  # equal values
    assert _check_step_values.cache_info().hits >= 1
    for a, b in zip(miss, hit, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_c_kernel_coefficients_equal_the_torch_float64_ones(kind):
    # The C sampler writes a x + b v + n eps: unit inputs expose each per-row coefficient.
    from grpo_kernels.sde_coefficients import step_coefficients
    from grpo_kernels.step_params import step_params

    sigma = torch.tensor([1.0, 0.8, 0.55, 0.2])
    sigma_next = torch.tensor([0.9, 0.7, 0.3, 0.05])
    ones, zeros = torch.ones(4, 3), torch.zeros(4, 3)
    step = step_params(ones, sigma, sigma_next, 0.7, SIGMA_MAX)
    want = step_coefficients(step, kind, "mean", 3, 4, ones.device)
    for i, (x, v, e) in enumerate([(ones, zeros, zeros), (zeros, ones, zeros),
                                   (zeros, zeros, ones)]):
        got = gk.sde_step_sample(x, v, e, sigma, sigma_next, eta=0.7, kind=kind,
                                 sigma_max=SIGMA_MAX, backend="cpu_fused")[0]
        assert torch.equal(got[:, 0], want[i].float()), (kind, "abn"[i])


def test_coefficient_cache_never_returns_stale_values():
    x, v, x_next, sigma, sigma_next = _inputs((3, 4, 5))
    before = _logp_and_grad_v(x, v, x_next, sigma, sigma_next)
    sigma_next.sub_(0.01)  # the same tensor object, changed in place
    after = _logp_and_grad_v(x, v, x_next, sigma, sigma_next)
    want = _logp_and_grad_v(x, v, x_next, sigma, sigma_next, backend="reference")
    assert not torch.equal(before[0], after[0])
    for got, ref in zip(after, want, strict=True):
        _close(got, ref, rtol=1e-5)
    # Every other part of the key matters too: kind, reduction, eta, sigma_max, latent size.
    base = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, sigma_max=SIGMA_MAX)
    for kwargs in (dict(kind="dance"), dict(reduction="sum"), dict(eta=0.8),
                   dict(sigma_max=0.9)):
        args = dict(eta=0.7, sigma_max=SIGMA_MAX) | kwargs
        other = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, **args)
        ref = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, backend="reference", **args)
        assert not torch.equal(other, base)
        _close(other, ref, rtol=1e-5)
    wider = [torch.cat([t, t], dim=2) for t in (x, v, x_next)]  # same sigmas, N doubled
    ref = gk.sde_step_logprob(*wider, sigma, sigma_next, eta=0.7, sigma_max=SIGMA_MAX,
                              backend="reference")
    _close(gk.sde_step_logprob(*wider, sigma, sigma_next, eta=0.7, sigma_max=SIGMA_MAX), ref,
           rtol=1e-5)


def test_value_check_cache_keeps_no_invalid_entry_and_is_bounded():
    from grpo_kernels.validation import _check_step_values

    x, v, x_next, _, _ = _inputs((2, 3, 4))
    for _ in range(2):  # raised on every call, never served from the cache
        with pytest.raises(ValueError, match="sigma_next must satisfy"):
            gk.sde_step_logprob(x, v, x_next, 0.5, 0.6, eta=0.7)
    for i in range(_check_step_values.cache_info().maxsize + 10):
        gk.sde_step_logprob(x, v, x_next, 0.5, 0.4 - i * 1e-4, eta=0.7, kind="dance")
    info = _check_step_values.cache_info()
    assert info.currsize == info.maxsize


@pytest.mark.parametrize("backend", ["reference", "cpu_fused", "triton"])
def test_signed_zero_gives_one_result(backend):
    # -0.0 == 0.0: the result must not depend on the sign of a zero sigma_next.
    x, v, x_next, _, _ = _inputs((2, 3, 4))
    out = [gk.sde_step_logprob(x, v, x_next, 0.5, zero, eta=0.7, kind="cps_mse",
                               backend=backend) for zero in (0.0, -0.0, torch.tensor(-0.0))]
    assert all(torch.equal(out[0], o) for o in out[1:])


def test_backward_of_sum_equals_explicit_ones():
    # .sum()'s backward hands over an expanded (stride 0) gradient: read in place, not copied.
    x, v, x_next, sigma, sigma_next = _inputs((3, 40000), seed=10)
    v = v.requires_grad_()
    logp = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, sigma_max=SIGMA_MAX)
    (expanded,) = torch.autograd.grad(logp.sum(), v, retain_graph=True)
    (explicit,) = torch.autograd.grad(logp, v, torch.ones(3))
    assert torch.equal(expanded, explicit)


@pytest.mark.parametrize("backend", ["reference", "cpu_fused", "triton"])
@pytest.mark.parametrize("make", ["np.float32", "np.float64", "np.int64 eta", "0-d ndarray"])
def test_numpy_step_values_are_accepted(make, backend):
    x, v, x_next, _, _ = _inputs((2, 3, 4))
    values = {"np.float32": dict(sigma=np.float32(0.75), sigma_next=np.float32(0.625)),
              "np.float64": dict(sigma=np.float64(0.75), sigma_max=np.float64(SIGMA_MAX)),
              "np.int64 eta": dict(eta=np.int64(1)),
              "0-d ndarray": dict(sigma_next=np.array(0.625, dtype=np.float32))}[make]
    base = dict(sigma=0.75, sigma_next=0.625, eta=1 if "eta" in make else 0.7,
                sigma_max=SIGMA_MAX)
    want = gk.sde_step_logprob(x, v, x_next, backend=backend, **base)
    got = gk.sde_step_logprob(x, v, x_next, backend=backend, **(base | values))
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["reference", "cpu_fused", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_noise_is_rejected_when_validating(bad, backend):
    x, v, _, sigma, sigma_next = _inputs((2, 3, 4))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    noise[1, 2, 3] = bad
    kwargs = dict(eta=0.7, kind="dance", backend=backend)
    with pytest.raises(ValueError, match="noise contains NaN or Inf; draw it with torch.randn"):
        gk.sde_step_sample(x, v, noise, sigma, sigma_next, **kwargs)
    x_next, logp = gk.sde_step_sample(x, v, noise, sigma, sigma_next, validate=False, **kwargs)
    assert not torch.isfinite(x_next[1]).all() and torch.isfinite(logp[0])


def test_nan_velocity_still_propagates_through_sampling():
    # Only the noise is checked: a NaN velocity gives a NaN sample, as before (the trainer
    # detects divergence itself).
    x, v, _, sigma, sigma_next = _inputs((2, 3, 4))
    v[0, 0, 0] = float("nan")
    x_next, logp = gk.sde_step_sample(x, v, torch.zeros_like(x), sigma, sigma_next, eta=0.7,
                                      kind="dance")
    assert logp[0].isnan() and not logp[1].isnan()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eta=-1.0), "eta must be a finite number"),
        (dict(eta=0.0), "eta must be a finite number"),
        (dict(eta=float("nan")), "eta must be a finite number"),
        (dict(eta=float("inf")), "eta must be a finite number"),
        (dict(eta=0.7, sigma_max=1.0), "sigma_max must be a finite number"),
        (dict(eta=0.7, sigma_max=float("nan")), "sigma_max must be a finite number"),
        (dict(eta=0.7, kind="sde"), "kind must be one of"),
        (dict(eta=0.7, reduction="none"), "reduction must be one of"),
        (dict(eta=0.7, backend="gpu"), "backend must be"),
    ],
)
def test_module_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gk.SdeStepLogprob(**kwargs)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(sigma=float("nan")), "sigma must lie in"),
        (dict(sigma_next=float("-inf")), "sigma_next must satisfy"),
        (dict(eta=float("inf")), "eta must be a finite number > 0"),
        (dict(kind="flow", sigma=1.0, sigma_next=0.9, sigma_max=float("nan")),
         "sigma_max is required"),
        (dict(kind="flow", sigma=torch.tensor([1.0, 0.5]), sigma_next=0.4,
              sigma_max=float("inf")), "sigma_max must lie"),
        (dict(eta=np.float32("nan")), "eta must be a finite number > 0"),
        (dict(sigma="0.5"), "sigma must be a real number or a float tensor, got str"),
        (dict(sigma=True), "sigma must be a real number or a float tensor, got bool"),
    ],
)
def test_every_step_number_must_be_finite_and_in_range(overrides, match):
    with pytest.raises(ValueError, match=match):
        _call(**overrides)
