"""torch.ops.megamoe.forward / forward_out: the layer's forward as torch operators.

Registered with torch.library.Library directly (define + impl per dispatch key) rather than
torch.library.custom_op, whose Python wrapper adds host overhead to every eager call. The fake
(meta) implementations give torch.compile the output's shape without running anything; the fake
of `forward` returns a new tensor (never an input), `forward_out` declares `out` mutated.
A layer crosses as its integer handle (megamoe.torch.MoeLayer.handle), a constant in a traced graph.
"""
from __future__ import annotations

import torch

from . import _layer_of

_lib = torch.library.Library("megamoe", "DEF")
_lib.define("forward(int handle, Tensor x, Tensor? x_scale, Tensor topk_ids, Tensor topk_weights) -> Tensor")
_lib.define(
    "forward_out(int handle, Tensor x, Tensor? x_scale, Tensor topk_ids, Tensor topk_weights, Tensor(a!) out) -> ()")


def _forward(handle, x, x_scale, topk_ids, topk_weights):
    layer = _layer_of(handle)
    out = torch.empty((x.shape[0], layer.hidden), dtype=torch.bfloat16, device=x.device)
    layer._run(x, x_scale, topk_ids, topk_weights, out)
    return out


def _forward_out(handle, x, x_scale, topk_ids, topk_weights, out):
    _layer_of(handle)._run(x, x_scale, topk_ids, topk_weights, out)


for _key in ("CPU", "CUDA"):
    _lib.impl("forward", _forward, _key)
    _lib.impl("forward_out", _forward_out, _key)


@torch.library.register_fake("megamoe::forward", lib=_lib)
def _forward_fake(handle, x, x_scale, topk_ids, topk_weights):
    return x.new_empty((x.shape[0], _layer_of(handle).hidden), dtype=torch.bfloat16)


@torch.library.register_fake("megamoe::forward_out", lib=_lib)
def _forward_out_fake(handle, x, x_scale, topk_ids, topk_weights, out):
    return None


# The overloads the layer calls (resolved once: attribute lookups on torch.ops cost host time).
forward = torch.ops.megamoe.forward.default
forward_out = torch.ops.megamoe.forward_out.default
