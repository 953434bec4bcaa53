"""Activation memory of the transformer's calls, measured with FakeTensor (no memory, no FLOPs).

`measure_call` runs a forward (and backward) under two probes:
- ``torch.autograd.graph.saved_tensors_hooks``: the bytes autograd saves for backward (distinct
  storages, parameters excluded);
- `LiveMemoryProbe`, a dispatch mode: the peak of the bytes of every live tensor the call
  created (activations, temporaries, and the casts of weights autocast makes), parameters and
  their gradients excluded (the plan counts those on their own lines). Storages are followed
  with weak references, so a tensor counts exactly while something still holds it.

The same probes run on real tensors (the tests compare a real CPU call of a tiny FLUX with its
FakeTensor twin). `estimate_flux_call` measures FLUX-shaped transformers with 1 and 2 blocks of
each kind under FakeTensorMode and extrapolates linearly to the real block counts: every block
of a kind saves the same bytes, so the saved bytes are linear in the counts, and so are the
forward's and the backward's peaks, taken apart (each is what is saved so far plus one block's
temporaries). Mixed precision is simulated with CPU autocast; CUDA autocast's op lists differ
a little.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from chunk_grpo.models.policy_setup import resolve_lora_targets
from chunk_grpo.plan.models import build_transformer, build_vae

_CASTS = (torch.ops.aten._to_copy.default,)


def _storage_key(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


class LiveMemoryProbe(TorchDispatchMode):
    """Peak bytes of the live tensors created inside it, per phase (set ``phase`` between the
    forward and the backward), not counting the storages in ``exclude`` (weights, gradients).
    Tensors cast from a weight (autocast's copies) are told apart: `weight_copy_bytes`."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude
        self.weights = set(exclude)
        self.live: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self.upper_bound = 0  # bytes of every tracked storage, dead ones included until a purge
        self.phase = "forward"
        self.peaks = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        copy = func in _CASTS and isinstance(args[0], torch.Tensor) and \
            _storage_key(args[0]) in self.weights
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = StorageWeakRef(storage).cdata
            if key in self.live or key in self.exclude:
                continue
            self.live[key] = (StorageWeakRef(storage), storage.nbytes(), copy)
            self.upper_bound += storage.nbytes()
        if self.upper_bound > self.peaks[self.phase]:  # only then can the peak have grown
            total = self.live_bytes()
            self.peaks[self.phase] = max(self.peaks[self.phase], total)
        return out

    def live_bytes(self, copies_only: bool = False) -> int:
        """Bytes alive now (dropping dead storages); ``copies_only``: of weight casts only."""
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        total = copies = 0
        for key, (_ref, nbytes, copy) in self.live.items():
            if key not in self.exclude:
                total += nbytes
                copies += nbytes if copy else 0
        self.upper_bound = total
        return copies if copies_only else total


@dataclass(frozen=True)
class CallMemory:
    """Bytes of one call, weights and gradients not included: saved for backward, the peak of
    live activations and temporaries in the forward and in the backward, and the weight casts
    (autocast's copies) alive when the forward ends."""

    saved: int
    forward_peak: int
    backward_peak: int = 0
    weight_copies: int = 0

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)

    def _combine(self, other: CallMemory, op) -> CallMemory:
        return CallMemory(*(op(a, b) for a, b in zip(dataclasses.astuple(self),
                                                      dataclasses.astuple(other), strict=True)))

    def __add__(self, other: CallMemory) -> CallMemory:
        return self._combine(other, lambda a, b: a + b)

    def __sub__(self, other: CallMemory) -> CallMemory:
        return self._combine(other, lambda a, b: a - b)

    def __mul__(self, k: float) -> CallMemory:
        return CallMemory(*(round(v * k) for v in dataclasses.astuple(self)))


def measure_call(run: Callable[[], torch.Tensor], params: Iterable[nn.Parameter], *,
                 backward: bool = True) -> CallMemory:
    """Memory of ``run()`` (a forward returning a scalar loss), then its backward if asked.
    Works on real tensors and inside a FakeTensorMode alike."""
    params = list(params)
    exclude = {_storage_key(p) for p in params}
    probe = LiveMemoryProbe(exclude)
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p: exclude.add(_storage_key(p.grad))) for p in params if p.requires_grad]
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in probe.weights:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    try:
        with probe:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = run()
            copies = probe.live_bytes(copies_only=True)
            if backward:
                probe.phase = "backward"
                loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return CallMemory(sum(saved.values()), probe.peaks["forward"], probe.peaks["backward"],
                      copies)


# ----------------------------------------------------------------------------- FLUX calls

@dataclass(frozen=True)
class CallShape:
    """One transformer call: rows (chunk size x micro-batch in training), image tokens
    ((H/16) x (W/16)) and T5 text tokens."""

    rows: int
    image_tokens: int
    text_tokens: int


@dataclass(frozen=True)
class CallPrecision:
    """Dtypes of the call: the trainable weights, the frozen ones (LoRA's base), and autocast's
    compute dtype (None: no autocast)."""

    trainable: torch.dtype = torch.float32
    frozen: torch.dtype = torch.float32
    autocast: torch.dtype | None = None


@dataclass(frozen=True)
class Adapters:
    """LoRA of ``rank`` on ``targets`` (rank 0: full fine-tuning)."""

    rank: int = 0
    targets: tuple[str, ...] = ()


def flux_call_inputs(config: dict, shape: CallShape, dtype: torch.dtype) -> dict:
    """Random inputs of a FluxTransformer2DModel call, as `FluxPolicy._forward` passes them."""
    rows, tokens, text = shape.rows, shape.image_tokens, shape.text_tokens
    guidance = torch.full((rows,), 3.5) if config.get("guidance_embeds") else None
    return dict(
        hidden_states=torch.randn(rows, tokens, config["in_channels"], dtype=dtype),
        timestep=torch.rand(rows, dtype=dtype),
        guidance=guidance,
        pooled_projections=torch.randn(rows, config["pooled_projection_dim"], dtype=dtype),
        encoder_hidden_states=torch.randn(rows, text, config["joint_attention_dim"], dtype=dtype),
        txt_ids=torch.zeros(text, 3, dtype=dtype),
        img_ids=torch.zeros(tokens, 3, dtype=dtype),
        return_dict=False,
    )


def prepare_for_measurement(transformer: nn.Module, *, train: bool, gradient_checkpointing: bool,
                            adapters: Adapters, precision: CallPrecision) -> nn.Module:
    """Set up ``transformer`` as the trainer does (`chunk_grpo.models.policy_setup`): LoRA adapters
    or every weight trainable, activation checkpointing, the weights' dtypes."""
    if adapters.rank > 0:
        from peft import LoraConfig

        transformer.requires_grad_(False)
        _cast_parameters(transformer, precision.frozen)
        transformer.add_adapter(LoraConfig(r=adapters.rank, lora_alpha=adapters.rank,
                                           target_modules=resolve_lora_targets(
                                               transformer, list(adapters.targets)),
                                           init_lora_weights="gaussian"))
        _cast_parameters(transformer, precision.trainable, trainable_only=True)
    else:
        _cast_parameters(transformer, precision.trainable)
        transformer.requires_grad_(train)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer.train(train)


def _cast_parameters(module: nn.Module, dtype: torch.dtype, trainable_only: bool = False) -> None:
    """Cast parameters in place (the trainable ones only, if asked)."""
    for p in module.parameters():
        if p.dtype != dtype and (p.requires_grad or not trainable_only):
            p.data = p.data.to(dtype)


def measure_flux_call(transformer: nn.Module, shape: CallShape, *, train: bool,
                      autocast: torch.dtype | None) -> CallMemory:
    """One call of a prepared transformer (real or fake): forward + backward of a scalar loss
    when ``train``, else a no-grad forward."""
    config = dict(transformer.config)
    inputs_dtype = next(transformer.parameters()).dtype if autocast is None else torch.float32
    inputs = flux_call_inputs(config, shape, inputs_dtype)

    def run() -> torch.Tensor:
        context = (torch.autocast("cpu", dtype=autocast) if autocast is not None
                   else torch.autocast("cpu", enabled=False))
        with context, torch.set_grad_enabled(train):
            out = transformer(**inputs)[0]
        return out.float().square().mean()

    return measure_call(run, transformer.parameters(), backward=train)


def materialize_fake(module: nn.Module) -> nn.Module:
    """Replace a meta-device module's parameters and buffers by CPU FakeTensors of the same
    shape, dtype and requires_grad (call inside the FakeTensorMode). Built on meta first because
    ``Module.to`` (which peft calls) cannot swap FakeTensor parameters."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="cpu"), p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")
    return module


def _fake_flux_call(config: dict, shape: CallShape, *, train: bool, gradient_checkpointing: bool,
                    adapters: Adapters, precision: CallPrecision) -> CallMemory:
    transformer = prepare_for_measurement(
        build_transformer(config, device="meta"), train=train,
        gradient_checkpointing=gradient_checkpointing, adapters=adapters, precision=precision)
    with FakeTensorMode():
        materialize_fake(transformer)
        return measure_flux_call(transformer, shape, train=train, autocast=precision.autocast)


def estimate_flux_call(config: dict, shape: CallShape, *, train: bool,
                       gradient_checkpointing: bool = False, adapters: Adapters = Adapters(),
                       precision: CallPrecision = CallPrecision()) -> CallMemory:
    """The call's memory for the full depth of ``config``, from FakeTensor runs of 1 and 2
    double-stream and single-stream blocks, extrapolated linearly in the block counts. A no-grad
    call keeps nothing from one block to the next, so its peak is that of 1 block of each kind."""
    doubles, singles = config["num_layers"], config["num_single_layers"]
    options = dict(train=train, gradient_checkpointing=gradient_checkpointing,
                   adapters=adapters, precision=precision)

    def depth(d: int, s: int) -> CallMemory:
        return _fake_flux_call({**config, "num_layers": d, "num_single_layers": s}, shape,
                               **options)

    base_d, base_s = min(doubles, 1), min(singles, 1)
    base = depth(base_d, base_s)
    if not train:  # nothing is kept between blocks without grad: one block of each kind tells
        return base
    total = base
    if doubles > 1:
        total = total + (depth(2, base_s) - base) * (doubles - 1)
    if singles > 1:
        total = total + (depth(base_d, 2) - base) * (singles - 1)
    return total


def estimate_vae_decode(config: dict, batch: int, height: int, width: int,
                        dtype: torch.dtype) -> CallMemory:
    """Peak of a no-grad VAE decode of ``batch`` latents to ``height`` x ``width`` images."""
    factor = 2 ** (len(config["block_out_channels"]) - 1)
    vae = build_vae(config, device="meta").eval().requires_grad_(False)
    _cast_parameters(vae, dtype)
    with FakeTensorMode():
        materialize_fake(vae)
        latents = torch.randn(batch, config["latent_channels"], height // factor,
                              width // factor, dtype=dtype)

        def run() -> torch.Tensor:
            with torch.no_grad():
                return vae.decode(latents, return_dict=False)[0].float().mean()

        return measure_call(run, vae.parameters(), backward=False)


# ----------------------------------------------------------------------------- analytic bounds
# What a start-up check can afford (microseconds, where the FakeTensor runs above take seconds):
# bytes every call must hold at once, whatever the kernels. They lie below the measurement
# (0.07-0.36 of it on the tiny model and FLUX.1-dev shapes, fp32 and bf16, with and without
# checkpointing), so a configuration they refuse cannot fit.

def bound_flux_call(config: dict, shape: CallShape, *, train: bool,
                    gradient_checkpointing: bool = False, compute_bytes: int = 4) -> CallMemory:
    """A lower bound on a FLUX call's activations: without grad, one block's MLP input and its
    4x-wide hidden layer; training, that hidden layer saved by every block (with checkpointing:
    every block's input, plus one block recomputed)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    blocks = config["num_layers"] + config["num_single_layers"]
    one = shape.rows * (shape.image_tokens + shape.text_tokens) * width * compute_bytes
    if not train:
        return CallMemory(saved=0, forward_peak=5 * one)
    saved = blocks * one if gradient_checkpointing else 4 * blocks * one
    return CallMemory(saved=saved, forward_peak=saved + (5 * one if gradient_checkpointing
                                                         else 0))


def bound_vae_decode(config: dict, batch: int, height: int, width: int,
                     dtype_bytes: int) -> CallMemory:
    """A lower bound on a VAE decode: the input and output of one full-resolution convolution
    of its first block's width."""
    peak = 2 * batch * config["block_out_channels"][0] * height * width * dtype_bytes
    return CallMemory(saved=0, forward_peak=peak)
