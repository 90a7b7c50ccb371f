"""SGLang: megamoe as a customized MoE all-to-all provider, loaded from the `sglang.plugins` entry point.

SGLang runs an MoE layer as dispatcher (`--moe-a2a-backend`) x runner (`--moe-runner-backend`). With
`--moe-a2a-backend customized`, an out-of-tree provider registered by a pip plugin supplies, per MoE
layer, a quant method (create_weights / process_weights_after_loading / apply) and a dispatcher. megamoe's
provider:

- the dispatcher is a pass-through: dispatch() hands the hidden states and the top-k output through
  unchanged, combine() returns the layer's output (already weighted and reduced);
- the quant method owns the megamoe layer: create_weights() registers the engine's usual expert
  parameters (w13_weight [E_local, 2I, H], w2_weight [E_local, H, I], weight_scale_inv for block fp8),
  process_weights_after_loading() builds the layer from them and warms it up (collective: every EP rank,
  before SGLang captures CUDA graphs; a build during capture raises), apply() runs one megamoe forward;
- routed_scaling_factor goes into MoeConfig.output_scale (the kernel applies it: SGLang must not apply
  it again after the kernel).

The hook into SGLang's registry is `register()` (the entry point in pyproject.toml). It calls the
registration function SGLang exposes for customized providers; where that API is absent it says so.
`MegaMoEProvider`, `MegaMoEQuantMethod` and `PassThroughDispatcher` depend on torch only, so they run
against a stand-in of SGLang's interface too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

import megamoe

from . import build_layer, comm_for, config_for, weights_from_params

logger = logging.getLogger(__name__)

PROVIDER_NAME = "megamoe"


@dataclass
class DispatchOutput:
    """What the pass-through dispatcher hands the quant method: the rank's own tokens and routing."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    hidden_states_scale: Optional[torch.Tensor] = None


class PassThroughDispatcher:
    """dispatch() and combine() move nothing: megamoe's layer does its own dispatch and combine."""

    def dispatch(self, hidden_states: torch.Tensor, topk_output: Any) -> DispatchOutput:
        topk_weights, topk_ids = _topk_of(topk_output)
        return DispatchOutput(hidden_states, topk_ids, topk_weights)

    def combine(self, combine_input: Any) -> torch.Tensor:
        return combine_input.hidden_states if hasattr(combine_input, "hidden_states") else combine_input


def _topk_of(topk_output):
    """(topk_weights, topk_ids) of SGLang's StandardTopKOutput (topk_weights, topk_ids, router_logits)."""
    if hasattr(topk_output, "topk_ids"):
        return topk_output.topk_weights, topk_output.topk_ids
    return topk_output[0], topk_output[1]


class MegaMoEQuantMethod:
    """The quant method of one MoE layer: the engine's expert parameters, and the megamoe layer."""

    def __init__(self, *, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, ep_size: int,
                 ep_rank: int, max_tokens_per_rank: int, params_dtype: torch.dtype, routed_scaling_factor=None,
                 ep_group=None, ep_cpu_group=None, backend: str = "auto"):
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.max_tokens_per_rank = max_tokens_per_rank
        self.params_dtype = params_dtype
        self.output_scale = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
        self.ep_group, self.ep_cpu_group = ep_group, ep_cpu_group
        self.backend = backend
        self.layer = None

    def create_weights(self, layer: torch.nn.Module, device=None) -> None:
        el = self.num_experts // self.ep_size
        H, I = self.hidden_size, self.intermediate_size

        def param(*shape, dtype=self.params_dtype):
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        layer.register_parameter("w13_weight", param(el, 2 * I, H))
        layer.register_parameter("w2_weight", param(el, H, I))
        if self.params_dtype == torch.float8_e4m3fn:
            layer.register_parameter("w13_weight_scale_inv", param(el, 2 * I // 128, H // 128, dtype=torch.float32))
            layer.register_parameter("w2_weight_scale_inv", param(el, H // 128, I // 128, dtype=torch.float32))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise megamoe.FailedPreconditionError(
                "megamoe layer built during CUDA-graph capture: build and warm up every MoE layer on every rank "
                "first (process_weights_after_loading runs before capture)")
        cfg = config_for(layer.w13_weight.dtype, backend=self.backend, output_scale=self.output_scale)
        weights = weights_from_params(layer.w13_weight, layer.w2_weight, getattr(layer, "w13_weight_scale_inv", None),
                                      getattr(layer, "w2_weight_scale_inv", None))
        self.layer = build_layer(hidden=self.hidden_size, intermediate=self.intermediate_size,
                                 num_experts=self.num_experts, top_k=self.top_k, ep_size=self.ep_size,
                                 ep_rank=self.ep_rank, max_tokens_per_rank=self.max_tokens_per_rank,
                                 weights=weights, config=cfg,
                                 comm=comm_for(self.ep_size, self.ep_group, self.ep_cpu_group))
        self.layer.warmup()

    def apply(self, layer: torch.nn.Module, dispatch_output: DispatchOutput) -> torch.Tensor:
        if self.layer is None:
            raise megamoe.FailedPreconditionError(
                "MegaMoEQuantMethod.apply() before process_weights_after_loading(): the megamoe layer is built and "
                "warmed up there (collective, every EP rank)")
        d = dispatch_output
        return self.layer(d.hidden_states, d.topk_ids, d.topk_weights, x_scale=d.hidden_states_scale)


class MegaMoEProvider:
    """The customized a2a provider: per MoE layer, a MegaMoEQuantMethod and a pass-through dispatcher."""

    name = PROVIDER_NAME

    def __init__(self, *, ep_group=None, ep_cpu_group=None, backend: str = "auto"):
        self.ep_group, self.ep_cpu_group, self.backend = ep_group, ep_cpu_group, backend

    def prepare_layer(self, *, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, ep_size: int,
                      ep_rank: int, max_tokens_per_rank: int, params_dtype: torch.dtype,
                      routed_scaling_factor=None, **_ignored):
        method = MegaMoEQuantMethod(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                                    intermediate_size=intermediate_size, ep_size=ep_size, ep_rank=ep_rank,
                                    max_tokens_per_rank=max_tokens_per_rank, params_dtype=params_dtype,
                                    routed_scaling_factor=routed_scaling_factor, ep_group=self.ep_group,
                                    ep_cpu_group=self.ep_cpu_group, backend=self.backend)
        return method, PassThroughDispatcher


def register(registry=None) -> bool:
    """Entry point of `sglang.plugins`: registers MegaMoEProvider as the `customized` a2a provider.

    registry: an object with register_moe_a2a_provider(name, provider) (the tests pass a stand-in);
    default SGLang's own. Returns False (with a log line) where SGLang has no such registry."""
    if registry is None:
        try:
            from sglang.srt.layers.moe import token_dispatcher as registry  # noqa: PLC0415
        except ImportError as e:
            logger.info("megamoe: SGLang's MoE dispatcher registry is not importable (%s); provider not registered", e)
            return False
    hook = getattr(registry, "register_moe_a2a_provider", None)
    if hook is None:
        logger.warning("megamoe: this SGLang has no register_moe_a2a_provider(); provider not registered")
        return False
    hook(PROVIDER_NAME, MegaMoEProvider)
    return True
