"""The MoE layer from Python: built once, warmed up once, then forward() per step.

The contract is the C++ one (include/megamoe/layer.h): create() validates and selects the backend
once; warmup() is collective (every rank, before any CUDA-graph capture); forward() computes
    y[t] = sum_j topk_weights[t, j] * FC2_e(silu(FC1g_e(x_t)) * FC1u_e(x_t)),  e = topk_ids[t, j]
for this rank's T tokens (T may be 0; -1 skips a slot). This module takes numpy arrays (the cpu
backend) and torch tensors (megamoe.torch adds the device path and the torch ops).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from . import _C
from ._tensors import BFLOAT16, view

Backend = _C.Backend


@dataclass
class MoeWeights:
    """This rank's experts (E_local = num_experts / ep_size), as the caller holds them.

    w13 [E_local, 2I, H] (rows [0, I) gate, [I, 2I) up) and w2 [E_local, H, I]: float32 or bfloat16,
    or float8_e4m3 with the DeepSeek-V3 fp32 128x128 `weight_scale_inv` in w13_scale
    [E_local, 2I/128, H/128] and w2_scale [E_local, H/128, I/128]; nvfp4 sources also carry the fp32
    per-expert global scales [E_local] (megamoe/weights.h has every source format). numpy arrays or
    torch tensors.
    """

    w13: Any
    w2: Any
    w13_scale: Any = None
    w2_scale: Any = None
    w13_global_scale: Any = None
    w2_global_scale: Any = None


def _config(config) -> "_C.MoeConfig":
    if config is None:
        return _C.MoeConfig()
    if isinstance(config, dict):
        return _C.MoeConfig(**config)
    return config


class MoeLayer:
    """One rank's MoE layer. Use as a context manager, or call release() when done."""

    def __init__(self, geometry: "_C.MoeGeometry", weights: MoeWeights, config=None, comm=None):
        cfg = _config(config)
        w = weights if isinstance(weights, MoeWeights) else MoeWeights(*weights)
        self._impl = _C.MoeLayer.create(
            geometry,
            cfg,
            view(w.w13, "w13"),
            view(w.w13_scale, "w13_scale"),
            view(w.w2, "w2"),
            view(w.w2_scale, "w2_scale"),
            comm,
            view(w.w13_global_scale, "w13_global_scale"),
            view(w.w2_global_scale, "w2_global_scale"),
        )
        self._geometry = self._impl.geometry
        self._hidden = self._geometry.hidden

    # ---- lifecycle ----
    @classmethod
    def create(cls, geometry, weights, config=None, comm=None) -> "MoeLayer":
        return cls(geometry, weights, config, comm)

    def warmup(self) -> "MoeLayer":
        """Collective: every rank of the group, before any CUDA-graph capture. Idempotent."""
        self._impl.warmup()
        return self

    def check_error(self, stream: int = 0) -> None:
        """Synchronises `stream` and raises what earlier forwards reported on the device."""
        self._impl.check_error(stream)

    def error_pending(self) -> bool:
        """Whether check_error() has a failure to report, without a host sync (poll it between steps;
        then check_error() raises it). Reads the latest snapshot of the device's error state that has
        arrived and starts the next, so it never waits: a failure shows at most one call late, then
        stays pending until check_error(). Always False on the cpu backend (forward() raises itself).
        After release(): FailedPreconditionError."""
        return self._impl.error_pending()

    def release(self) -> None:
        """Frees the layer now (its weights, and its share of the workspace). Idempotent."""
        if self._impl.alive:
            self._impl.destroy()

    def set_expert_counts(self, counts) -> None:
        """Per-local-expert receive counts (EPLB): every later forward adds the rows each local expert
        received to counts [experts_per_rank] (int64 or int32, on the layer's device); None stops."""
        self._expert_counts = counts  # the layer writes it: keep it alive
        self._impl.set_expert_counts(view(counts, "counts"))

    def expert_weight_views(self) -> list:
        """Per local expert, {"w13", "w13_scale", "w2", "w2_scale"} -> (device address, bytes) of the
        prepared weights the GPU backends' GEMMs read (megamoe/layer.h ExpertWeightView: w13 rows in
        the SwiGLU order, scales absent (0, 0) for bf16), for EPLB to move experts by copying those
        regions between forwards. Valid until release(). The cpu backend raises UnavailableError."""
        return self._impl.expert_weight_views()

    def __enter__(self) -> "MoeLayer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- forward ----
    def forward(self, x, topk_ids, topk_weights, out=None, *, x_scale=None, stream: int = 0):
        """y [T, H] bfloat16 for x [T, H] (bfloat16, or float8_e4m3 with x_scale [T, H/128] float32),
        topk_ids [T, k] int32 or int64, topk_weights [T, k] float32 or bfloat16. Writes `out` when given."""
        if out is None:
            if not isinstance(x, np.ndarray):
                raise TypeError("forward: give `out` for non-numpy inputs (or use megamoe.torch)")
            out = np.empty((x.shape[0], self._hidden), dtype=BFLOAT16)
        self._impl.forward(
            view(x, "x"), view(topk_ids, "topk_ids"), view(topk_weights, "topk_weights"), view(out, "y"), stream,
            view(x_scale, "x_scale"),
        )
        return out

    __call__ = forward

    # ---- what it is ----
    @property
    def backend(self) -> "_C.Backend":
        return self._impl.backend

    @property
    def device(self) -> str:
        kind, index = self._impl.device
        return "cpu" if kind == int(_C.DeviceKind.cpu) else f"cuda:{index}"

    @property
    def geometry(self) -> "_C.MoeGeometry":
        return self._geometry

    @property
    def config(self) -> "_C.MoeConfig":
        return self._impl.config

    @property
    def selection_reason(self) -> str:
        return self._impl.selection_reason

    def __repr__(self) -> str:
        if not self._impl.alive:
            return "MoeLayer(released)"
        return f"MoeLayer(backend={_C.name_of(self.backend)}, device={self.device}, {self._geometry!r})"


def select_backend(geometry, config=None) -> tuple:
    """(backend, reason): the rule `auto` applies when a layer is built, with the real gates."""
    return _C.select_backend(geometry, _config(config))


def capabilities(geometry, config=None) -> dict:
    """{backend name: None if its static gate passes, else the reason}. Never touches the network."""
    cfg = _config(config)
    out = {}
    for b in (Backend.mega, Backend.routed, Backend.cpu):
        code, message = _C.capability(b, geometry, cfg)
        out[_C.name_of(b)] = None if code == 0 else message
    return out


def host_group(size: int) -> list:
    """`size` ranks as threads of this process (the cpu backend); drive each from its own thread."""
    return _C.create_host_group(size)


def nccl_group(devices: Sequence[int]) -> list:
    """One process driving len(devices) GPUs (ncclCommInitAll); one thread per rank for collectives."""
    return _C.create_nccl_group(list(devices))


def nccl_rank(rank: int, world_size: int, id_hex: str, device: Optional[int] = None):
    """This process's rank of a one-process-per-GPU group; `id_hex` from rank 0's nccl_unique_id()."""
    return _C.create_nccl_rank(rank, world_size, rank if device is None else device, id_hex)


def nccl_unique_id() -> str:
    """A fresh NCCL unique id as 256 hex digits (rank 0 makes it, every rank passes it to nccl_rank)."""
    return _C.nccl_unique_id_hex()
