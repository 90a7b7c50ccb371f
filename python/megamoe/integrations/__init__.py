"""Adapters of megamoe to the inference engines: vLLM, SGLang and TensorRT-LLM.

All three take a fused dispatch + GEMM + combine library the same way: the engine's dispatch step is a
pass-through, one experts object owns the weights, the workspace and the fused call (megamoe's whole
layer), and a collective build + warm-up runs before CUDA-graph capture. Each adapter is built from
the engine's own base classes when the engine imports (vllm.py, sglang.py, trtllm.py say which), and
can be built from a stand-in module with the same names (the tests do). docs/INTEGRATION.md gives the
launch flags and what has been verified where.

Shared here: the layer built from an engine layer's parameters (`build_layer`).
"""
from __future__ import annotations

from typing import Optional

import torch

import megamoe
import megamoe.torch as mt


def weights_from_params(w13, w2, w13_scale=None, w2_scale=None) -> megamoe.MoeWeights:
    """MoeWeights from an engine layer's expert parameters: w13 [E_local, 2I, H] (gate rows, then up
    rows, as vLLM, SGLang and TensorRT-LLM store w13), w2 [E_local, H, I]; for DeepSeek-style fp8
    checkpoints e4m3 with the 128x128 fp32 weight_scale_inv."""
    data = [t.data if isinstance(t, torch.nn.Parameter) else t for t in (w13, w2, w13_scale, w2_scale)]
    return megamoe.MoeWeights(*data)


def config_for(weight_dtype: torch.dtype, backend: str = "auto", **overrides) -> megamoe.MoeConfig:
    """The MoeConfig for an engine's expert weights: fp8-block for e4m3 (block-scaled) weights, bf16
    otherwise; `overrides` set any other MoeConfig field (e.g. output_scale)."""
    fmt = "fp8-block" if weight_dtype == torch.float8_e4m3fn else "bf16"
    cfg = megamoe.MoeConfig(backend=backend, weight_format=fmt, dispatch_format=fmt)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


def build_layer(*, hidden: int, intermediate: int, num_experts: int, top_k: int, ep_size: int, ep_rank: int,
                max_tokens_per_rank: int, weights: megamoe.MoeWeights, config: megamoe.MoeConfig,
                comm=None) -> mt.MoeLayer:
    """This rank's megamoe.torch layer (not warmed up: warm-up is collective, the caller's step)."""
    g = megamoe.MoeGeometry(hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                            ep_size=ep_size, ep_rank=ep_rank, max_tokens_per_rank=max_tokens_per_rank)
    return mt.MoeLayer(g, weights, config, comm)


def comm_for(ep_size: int, group=None, cpu_group=None, device: Optional[int] = None):
    """None for one rank; else the cached NCCL communicator of the engine's EP group."""
    if ep_size <= 1:
        return None
    return mt.comm_from_process_group(group, cpu_group=cpu_group, device=device)
