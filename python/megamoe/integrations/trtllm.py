"""TensorRT-LLM (PyTorch flow): megamoe as a MoE backend module.

TensorRT-LLM's fused-MoE modules (tensorrt_llm/_torch/modules/fused_moe/) subclass `MoE` and implement
create_weights / load_weights / post_load_weights / forward_impl / forward_fake; the backend factory
asks a static `can_implement(...) -> (bool, reason)` and falls back with the logged reason
(MEGAMOE_AUTO). `MegaMoE`, built by `moe_class(MoE)`:

- create_weights(): w13_weight [E_local, 2I, H], w2_weight [E_local, H, I] (+ fp32 128x128
  weight_scale_inv for DeepSeek fp8 block scales), as the other backends register them;
- load_weights(weights): the VANILLA layout, per local expert e: "{e}.w1.weight" (gate), "{e}.w3.weight"
  (up), "{e}.w2.weight" (+ ".weight_scale_inv"); w1 and w3 are stacked into w13;
- post_load_weights(): the collective point: build the megamoe layer and warm it up, every EP rank,
  before CUDA-graph capture;
- forward_impl(x, router_logits): the routing method's top-k (int32 ids, fp32 weights), one megamoe
  forward; forward_fake(): an empty [T, H] bf16 tensor for tracing.

`MegaMoE` imported from this module is built on TensorRT-LLM's own `MoE` (when it imports).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

import megamoe

from . import build_layer, comm_for, config_for, weights_from_params


def can_implement(quant_algo: Optional[str], dtype_activation: torch.dtype, *, hidden_size: int,
                  intermediate_size: int, num_experts: int, top_k: int, ep_size: int, swiglu: bool = True,
                  sm_version: Optional[int] = None) -> Tuple[bool, Optional[str]]:
    """Whether megamoe runs this MoE: (True, None), or (False, why). Static: no device access beyond the
    SM version (pass sm_version to answer for another device)."""
    if sm_version is None:
        sm_version = (lambda c: c[0] * 10 + c[1])(torch.cuda.get_device_capability()) if torch.cuda.is_available() else 0
    if sm_version != 90:
        return False, f"megamoe's GPU kernels are built for sm_90a (Hopper); this device is sm_{sm_version}"
    if not swiglu:
        return False, "megamoe's experts are SwiGLU (gate and up projections, silu)"
    if dtype_activation != torch.bfloat16:
        return False, f"megamoe takes bfloat16 activations (got {dtype_activation})"
    if quant_algo not in (None, "FP8_BLOCK_SCALES"):
        return False, f"megamoe runs bf16 or FP8_BLOCK_SCALES experts (got quant_algo={quant_algo})"
    g = megamoe.MoeGeometry(hidden=hidden_size, intermediate=intermediate_size, num_experts=num_experts,
                            top_k=top_k, ep_size=ep_size, ep_rank=0, max_tokens_per_rank=1)
    try:
        g.validate()
    except megamoe.InvalidArgumentError as e:
        return False, str(e)
    fmt = "fp8-block" if quant_algo == "FP8_BLOCK_SCALES" else "bf16"
    gates = megamoe.capabilities(g, megamoe.MoeConfig(weight_format=fmt, dispatch_format=fmt))
    if gates["routed"] is not None and gates["mega"] is not None:
        return False, gates["routed"]
    return True, None


def moe_class(moe_base):
    """MegaMoE on top of TensorRT-LLM's MoE interface class (or a stand-in with its constructor)."""

    class MegaMoE(moe_base):
        def __init__(self, *, routing_method, num_experts: int, hidden_size: int, intermediate_size: int,
                     dtype: Optional[torch.dtype] = None, reduce_results: bool = False, model_config=None,
                     max_tokens_per_rank: Optional[int] = None, routed_scaling_factor: Optional[float] = None,
                     ep_group=None, ep_cpu_group=None, **kwargs):
            super().__init__(routing_method=routing_method, num_experts=num_experts, hidden_size=hidden_size,
                             intermediate_size=intermediate_size, dtype=dtype, reduce_results=reduce_results,
                             model_config=model_config, **kwargs)
            self.top_k = routing_method.experts_per_token
            mc = model_config
            self.max_tokens_per_rank = max_tokens_per_rank or getattr(mc, "max_num_tokens", 8192)
            self.output_scale = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
            self.ep_group, self.ep_cpu_group = ep_group, ep_cpu_group
            self.expert_size_per_partition = num_experts // self.ep_size
            qc = getattr(mc, "quant_config", None)
            self.fp8_block = getattr(qc, "quant_algo", None) == "FP8_BLOCK_SCALES"
            self.megamoe_layer = None
            self._weights_created = False

        can_implement = staticmethod(can_implement)

        def create_weights(self):
            el, H, I = self.expert_size_per_partition, self.hidden_size, self.intermediate_size
            dt = torch.float8_e4m3fn if self.fp8_block else (self.dtype or torch.bfloat16)

            def param(*shape, dtype=dt):
                return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

            self.w13_weight = param(el, 2 * I, H)
            self.w2_weight = param(el, H, I)
            if self.fp8_block:
                self.w13_weight_scale_inv = param(el, 2 * I // 128, H // 128, dtype=torch.float32)
                self.w2_weight_scale_inv = param(el, H // 128, I // 128, dtype=torch.float32)
            self._weights_created = True

        def load_weights(self, weights: List[Dict]):
            assert len(weights) == 1, "one checkpoint dict"
            w = weights[0]
            first = self.ep_rank * self.expert_size_per_partition
            I = self.intermediate_size
            for local in range(self.expert_size_per_partition):
                e = first + local
                self.w13_weight.data[local, :I].copy_(w[f"{e}.w1.weight"])
                self.w13_weight.data[local, I:].copy_(w[f"{e}.w3.weight"])
                self.w2_weight.data[local].copy_(w[f"{e}.w2.weight"])
                if self.fp8_block:
                    self.w13_weight_scale_inv.data[local, :I // 128].copy_(w[f"{e}.w1.weight_scale_inv"])
                    self.w13_weight_scale_inv.data[local, I // 128:].copy_(w[f"{e}.w3.weight_scale_inv"])
                    self.w2_weight_scale_inv.data[local].copy_(w[f"{e}.w2.weight_scale_inv"])

        def post_load_weights(self):
            """The collective point: build this rank's megamoe layer and warm it up (every EP rank)."""
            cfg = config_for(self.w13_weight.dtype, output_scale=self.output_scale)
            weights = weights_from_params(self.w13_weight, self.w2_weight, getattr(self, "w13_weight_scale_inv", None),
                                          getattr(self, "w2_weight_scale_inv", None))
            self.megamoe_layer = build_layer(hidden=self.hidden_size, intermediate=self.intermediate_size,
                                             num_experts=self.num_experts, top_k=self.top_k, ep_size=self.ep_size,
                                             ep_rank=self.ep_rank, max_tokens_per_rank=self.max_tokens_per_rank,
                                             weights=weights, config=cfg,
                                             comm=comm_for(self.ep_size, self.ep_group, self.ep_cpu_group))
            self.megamoe_layer.warmup()

        def forward_impl(self, x: torch.Tensor, router_logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if self.megamoe_layer is None:
                raise megamoe.FailedPreconditionError(
                    "MegaMoE.forward before post_load_weights(): the megamoe layer is built and warmed up there "
                    "(collective, every EP rank, before CUDA-graph capture)")
            topk_ids, topk_weights = self.routing_method.apply(router_logits)
            return self.megamoe_layer(x, topk_ids, topk_weights)

        def forward_fake(self, x: torch.Tensor, router_logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return x.new_empty((x.shape[0], self.hidden_size), dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor, router_logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return self.forward_impl(x, router_logits, *args, **kwargs)

    return MegaMoE


def __getattr__(name):
    if name == "MegaMoE":
        from tensorrt_llm._torch.modules.fused_moe.interface import MoE  # noqa: PLC0415

        cls = moe_class(MoE)
        globals()[name] = cls
        return cls
    raise AttributeError(name)
