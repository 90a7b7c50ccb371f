"""megamoe for torch: the layer on torch tensors, the torch ops, and the process-group bootstrap.

Pure Python over megamoe._C (raw data pointers and the current CUDA stream; no torch C++ ABI), so
one wheel serves every torch version.

    import megamoe.torch as mt
    comm = mt.comm_from_process_group(ep_group, cpu_group=ep_cpu_group)   # collective, cached
    layer = mt.MoeLayer(geometry, megamoe.MoeWeights(w13, w2, w13_scale, w2_scale), config, comm)
    mt.warmup_all()                        # collective, every rank, before CUDA-graph capture
    y = layer(x, topk_ids, topk_weights)   # one forward on the current stream

- x: bf16 [T, H], or float8_e4m3fn with x_scale [T, H/128] fp32; topk_ids int32 or int64 (an int64
  tensor is converted on the device by the layer, never through the host); topk_weights fp32 or bf16.
- out: preallocated (forward_out), or allocated from torch's caching allocator on x's device.
- The ops `megamoe::forward` / `megamoe::forward_out` have fake implementations, so
  torch.compile(fullgraph=True) traces through them; a layer crosses an op as an integer handle.
  Traced code, tensor subclasses and dispatch modes go through the ops; a plain eager call runs the
  ops' body directly (the same launches, less host time).
- A forward under CUDA-graph capture before warmup() raises FailedPreconditionError (call warmup()
  on every rank first).
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from .. import _C
from ..errors import InvalidArgumentError
from ..layer import MoeLayer as _HostLayer
from ..layer import MoeWeights

__all__ = [
    "MoeLayer", "MoeWeights", "warmup_all", "destroy_all", "layers", "comm_from_process_group", "adopt_nccl_comm",
    "tensor_view",
]

_DEVICE_CPU = int(_C.DeviceKind.cpu)
_DEVICE_CUDA = int(_C.DeviceKind.cuda)

_TORCH_DTYPES = {
    torch.float32: _C.DType.float32,
    torch.float64: _C.DType.float64,
    torch.bfloat16: _C.DType.bfloat16,
    torch.float16: _C.DType.float16,
    torch.int32: _C.DType.int32,
    torch.int64: _C.DType.int64,
    torch.uint8: _C.DType.uint8,
    torch.float8_e4m3fn: _C.DType.float8_e4m3,
}
if hasattr(torch, "float8_e8m0fnu"):
    _TORCH_DTYPES[torch.float8_e8m0fnu] = _C.DType.float8_e8m0
_TORCH_CODES = {d: int(c) for d, c in _TORCH_DTYPES.items()}


def _tensor_view(t: torch.Tensor) -> tuple:
    """The _C tuple of a torch tensor (its storage stays the caller's)."""
    code = _TORCH_CODES.get(t.dtype)
    if code is None:
        raise InvalidArgumentError(f"invalid argument: dtype={t.dtype}, megamoe takes none of that dtype")
    index = t.get_device()  # torch.Size is a tuple: it crosses as the shape without a copy
    if index < 0:
        return (t.data_ptr(), code, t.shape, t.stride(), _DEVICE_CPU, 0)
    return (t.data_ptr(), code, t.shape, t.stride(), _DEVICE_CUDA, index)


tensor_view = _tensor_view
_C._set_tensor_dtypes([(d, int(c)) for d, c in _TORCH_DTYPES.items()])  # for MoeLayer._run

_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack  # active TorchDispatchModes (0 in plain eager)

if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream
else:  # pragma: no cover (older torch)
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


# ---- the registry: layers by handle, in creation order ----

_layers: "dict[int, MoeLayer]" = {}
_next_handle = itertools.count(1)


def layers() -> list:
    """The live layers, in creation order."""
    return list(_layers.values())


def warmup_all() -> None:
    """warmup() of every live layer, in creation order: collective, so every rank calls it, with the
    same layers, before any CUDA-graph capture (the engines' warm-up step)."""
    for layer in layers():
        layer.warmup()


def destroy_all() -> None:
    """release() of every live layer, in creation order."""
    for layer in layers():
        layer.release()


def _host_copy(t):
    """Weights for prepare_weights: host tensors as they are; device tensors through the host."""
    if t is None or not isinstance(t, torch.Tensor):
        return t
    return t if t.device.type == "cpu" else t.detach().to("cpu")


def _sync_producers(w: "MoeWeights") -> None:
    """Device-resident weights are read by create() on a private stream of their device, which waits
    for no other stream: finish the current stream's work on them first (the engine's loading, the
    .contiguous() copies above)."""
    for t in _fields(w):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
            return


class _DeviceRegion:
    """A layer's device bytes as __cuda_array_interface__ (torch.as_tensor aliases it, no copy);
    holds the layer so that the tensor keeps it alive."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _alias(ptr: int, nbytes: int, device: torch.device, owner) -> torch.Tensor:
    return torch.as_tensor(_DeviceRegion(ptr, nbytes, owner), device=device)


def _fields(w: MoeWeights) -> tuple:
    return (w.w13, w.w2, w.w13_scale, w.w2_scale, w.w13_global_scale, w.w2_global_scale)


class MoeLayer:
    """One rank's MoE layer on torch tensors. Build it on every rank, then warmup_all()."""

    def __init__(self, geometry, weights: MoeWeights, config=None, comm=None):
        w = weights if isinstance(weights, MoeWeights) else MoeWeights(*weights)
        w = MoeWeights(*(t.contiguous() if isinstance(t, torch.Tensor) else t for t in _fields(w)))
        _sync_producers(w)
        try:
            # Device tensors go straight through: the GPU backends prepare them on the device
            # (megamoe/weights.h: fp8-block e4m3 + fp32 scales, or bf16).
            self._layer = _HostLayer(geometry, w, config, comm)
            self.weights_via_host = False
        except InvalidArgumentError as e:
            if "copy the weights to the host first" not in str(e):
                raise
            # Refused on the device (another format or conversion, the cpu backend, another GPU
            # than the layer's): take the device tensors through the host.
            self._layer = _HostLayer(geometry, MoeWeights(*(_host_copy(t) for t in _fields(w))), config, comm)
            self.weights_via_host = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in _fields(w))
        self._impl = self._layer._impl
        self._forward = self._impl.forward_tensors  # the tensors read in C++, not packed here
        g = self._layer.geometry
        self.hidden = g.hidden
        self.top_k = g.top_k
        kind, index = self._impl.device
        self.device = torch.device("cpu") if kind == _DEVICE_CPU else torch.device("cuda", index)
        self._cuda_index = index if kind == _DEVICE_CUDA else -1
        self.handle = next(_next_handle)
        _layers[self.handle] = self

    # ---- lifecycle ----
    def warmup(self) -> "MoeLayer":
        self._layer.warmup()
        return self

    def check_error(self) -> None:
        """Synchronises the current stream and raises what earlier forwards reported on the device."""
        self._impl.check_error(self._stream())

    def error_pending(self) -> bool:
        """Whether check_error() has a failure to report, without a host sync (an engine polls it between
        steps, then calls check_error()); see megamoe.MoeLayer.error_pending."""
        return self._impl.error_pending()

    def release(self) -> None:
        _layers.pop(self.handle, None)
        self._layer.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def set_expert_counts(self, counts: Optional[torch.Tensor]) -> None:
        """Per-local-expert receive counts for EPLB: every later forward adds, on the device, the rows
        each local expert received to counts [experts_per_rank] (int64 or int32); None stops it."""
        self._expert_counts = counts  # kept alive while the layer writes it
        self._impl.set_expert_counts(None if counts is None else _tensor_view(counts))

    def expert_weight_views(self) -> list:
        """Per local expert, {"w13", "w13_scale", "w2", "w2_scale"} -> a flat uint8 tensor on the
        layer's device that aliases the prepared weights the kernels read (megamoe/layer.h
        ExpertWeightView; bf16 layers have no scale entries). EPLB moves an expert by copying its
        tensors into another expert's (same geometry and format), stream-ordered between forwards.
        Valid until release(); the cpu backend raises UnavailableError."""
        out = []
        for expert in self._impl.expert_weight_views():
            out.append({name: _alias(ptr, nbytes, self.device, self)
                        for name, (ptr, nbytes) in expert.items() if nbytes > 0})
        return out

    # ---- forward ----
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None, x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        if _is_compiling() or type(x) is not torch.Tensor or _dispatch_modes():
            # Traced (torch.compile, export), a tensor subclass, or a dispatch mode (fake tensors,
            # make_fx): through the torch ops, which those see.
            if out is None:
                return _ops.forward(self.handle, x, x_scale, topk_ids, topk_weights)
            _ops.forward_out(self.handle, x, x_scale, topk_ids, topk_weights, out)
            return out
        # Eager: the ops' body itself (the dispatcher's round trip into a Python kernel costs more host
        # time than the rest of the call); the same launches on the current stream, capturable alike.
        if out is None:
            out = torch.empty((x.shape[0], self.hidden), dtype=torch.bfloat16, device=x.device)
        self._run(x, x_scale, topk_ids, topk_weights, out)
        return out

    __call__ = forward

    def _stream(self) -> int:
        return _raw_stream(self._cuda_index) if self._cuda_index >= 0 else 0

    def _run(self, x, x_scale, topk_ids, topk_weights, out) -> None:
        """The op's body: one _C call on the current stream."""
        self._forward(x, topk_ids, topk_weights, out,
                      _raw_stream(self._cuda_index) if self._cuda_index >= 0 else 0, x_scale)

    # ---- what it is ----
    @property
    def backend(self):
        return self._layer.backend

    @property
    def geometry(self):
        return self._layer.geometry

    @property
    def config(self):
        return self._layer.config

    @property
    def selection_reason(self) -> str:
        return self._layer.selection_reason

    def __repr__(self) -> str:
        return f"megamoe.torch.{self._layer!r}"


def _layer_of(handle: int) -> MoeLayer:
    layer = _layers.get(handle)
    if layer is None:
        _C._raise_status(int(_C.StatusCode.failed_precondition),
                         f"megamoe layer handle {handle} is not live (released, or never created in this process)")
    return layer


from . import _ops  # noqa: E402,F401  (registers torch.ops.megamoe.*)
from .distributed import adopt_nccl_comm, comm_from_process_group  # noqa: E402
