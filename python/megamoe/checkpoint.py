"""One MoE layer's experts for this rank, read from a Hugging Face checkpoint directory as it ships
(config.json + *.safetensors, with model.safetensors.index.json when spread over several files).

The C++ loader (include/megamoe/checkpoint.h) does the work: it memory-maps the files, reads only
this rank's experts [r*E/R, (r+1)*E/R) of layer L, checks every tensor's name, dtype and shape
against config.json's geometry, and stacks them as megamoe takes them (w13 [E_local, 2I, H], gate
rows then up rows; w2 [E_local, H, I]) in the checkpoint's own format:

    ck = megamoe.load_checkpoint_experts("/models/DeepSeek-V3", layer=3, ep_size=8, ep_rank=rank)
    layer = megamoe.MoeLayer(ck.geometry, ck.weights, ck.config(), comm)   # fp8-block, bit for bit

The arrays are numpy views of the loader's host copy (they keep it alive); megamoe.torch takes them
through torch.from_numpy if the caller wants tensors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List

import numpy as np

from . import _C
from ._tensors import _ml
from .layer import MoeWeights

_WEIGHT_FIELDS = ("w13", "w13_scale", "w2", "w2_scale", "w13_global_scale", "w2_global_scale")


def _typed(bits, code):
    """The loader's array (bf16 as uint16, 8-bit types as uint8) in its own numpy dtype."""
    if bits is None:
        return None
    dtype = _C.DType(code)
    if dtype == _C.DType.bfloat16:
        return bits.view(_ml.bfloat16)
    if dtype == _C.DType.float8_e4m3:
        return bits.view(_ml.float8_e4m3fn)
    if dtype == _C.DType.float8_e8m0 and hasattr(_ml, "float8_e8m0fnu"):
        return bits.view(_ml.float8_e8m0fnu)
    return bits


@dataclass
class CheckpointExperts:
    """What load_checkpoint_experts() read: this rank's experts of one layer, and what they are."""

    geometry: "_C.MoeGeometry"   # from config.json, for this rank (validated)
    weights: MoeWeights          # host numpy arrays in the checkpoint's format
    weight_format: "_C.WeightFormat"
    layer: int
    layout: str                  # e.g. "fp8-block (DeepSeek-V3 e4m3 + weight_scale_inv per 128x128)"
    files: List[str]             # the safetensors files the tensors came from
    description: str             # "layer 3, ..., experts [0, 32) of 256, 2 files"

    def config(self, **fields) -> "_C.MoeConfig":
        """A MoeConfig whose weight_format keeps these weights bit for bit; `fields` set the rest."""
        cfg = _C.MoeConfig(**fields)
        cfg.weight_format = self.weight_format
        return cfg


def load_checkpoint_experts(path, layer: int, ep_size: int = 1, ep_rank: int = 0,
                            max_tokens_per_rank: int = 256) -> CheckpointExperts:
    """Layer `layer`'s experts that rank `ep_rank` of `ep_size` owns, from checkpoint directory `path`.

    Raises MegamoeIOError (an OSError) for a file that cannot be opened or mapped, and
    InvalidArgumentError naming the file and the tensor for contents that break a rule (missing tensor,
    wrong dtype or shape, truncated file, a layer without experts)."""
    if _ml is None:
        raise ImportError("megamoe.load_checkpoint_experts needs ml_dtypes (bf16 / e4m3 numpy arrays)")
    d = _C.load_checkpoint_experts(os.fspath(path), int(layer), int(ep_size), int(ep_rank), int(max_tokens_per_rank))
    arrays = {name: _typed(d[name], d[name + "_dtype"]) for name in _WEIGHT_FIELDS}
    return CheckpointExperts(geometry=d["geometry"], weights=MoeWeights(**arrays), weight_format=d["weight_format"],
                             layer=d["layer"], layout=d["layout"], files=list(d["files"]),
                             description=d["description"])
