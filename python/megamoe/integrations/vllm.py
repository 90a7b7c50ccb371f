"""vLLM: megamoe as the experts of vLLM's modular fused-MoE kernel.

vLLM splits a fused MoE into prepare/finalize (quantise + dispatch, combine) and experts. megamoe does
dispatch, both GEMMs and the combine itself, so it pairs with the pass-through prepare/finalize
(`--all2all-backend passthrough`, whose output is already reduced: hidden states stay on their rank)
and is the experts object:

- `MegaMoEExperts` subclasses `FusedMoEExpertsModular` (vllm/model_executor/layers/fused_moe/
  modular_kernel.py): standard activation format, unquantised inputs (megamoe quantises on its
  dispatch wire), `workspace_shapes -> (0,), (0,), (M, K)`, a no-op weight-and-reduce (the output is
  weighted and reduced), and `apply()` = one megamoe forward on the current stream, topk_ids int32
  (int64 from DeepEP-style callers is converted on the device); padded rows may carry id -1.
- `process_weights_after_loading(layer)` builds this rank's megamoe layer from the FusedMoE layer's
  w13_weight / w2_weight (and weight_scale_inv for block-fp8 checkpoints) and warms it up: collective,
  every EP rank, before vLLM captures CUDA graphs.

`experts_class(mk, reduce)` builds the class from vLLM's modules (or stand-ins with the same names,
as the tests do); importing `MegaMoEExperts` from this module builds it from vLLM itself.
"""
from __future__ import annotations

from typing import Optional

import torch

import megamoe

from . import build_layer, comm_for, config_for, weights_from_params


def experts_class(mk, weight_and_reduce_noop):
    """MegaMoEExperts on top of `mk.FusedMoEExpertsModular`; `weight_and_reduce_noop` is vLLM's
    TopKWeightAndReduceNoOP class."""

    class MegaMoEExperts(mk.FusedMoEExpertsModular):
        """Dispatch + FC1 + SwiGLU + FC2 + combine in megamoe; use with the pass-through prepare/finalize."""

        def __init__(self, moe_config, quant_config, *, megamoe_config: Optional[megamoe.MoeConfig] = None,
                     ep_group=None, ep_cpu_group=None, output_scale: float = 1.0):
            super().__init__(moe_config, quant_config)
            self.megamoe_config = megamoe_config
            self.ep_group = ep_group
            self.ep_cpu_group = ep_cpu_group
            self.output_scale = output_scale
            self.layer = None  # built in process_weights_after_loading

        # ---- what the modular kernel asks ----
        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True

        @staticmethod
        def _supports_current_device() -> bool:
            return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            # bf16 weights, or DeepSeek-style fp8 with 128x128 weight blocks (the key's repr names it)
            return weight_key is None or "128" in repr(weight_key)

        @staticmethod
        def _supports_activation(activation) -> bool:
            return "silu" in str(activation).lower()

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return getattr(moe_parallel_config, "tp_size", 1) == 1  # EP: every rank owns whole experts

        def supports_chunking(self) -> bool:
            return False

        def supports_expert_map(self) -> bool:
            return False  # megamoe takes global expert ids and owns the placement

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation=None):
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self):
            return weight_and_reduce_noop()

        # ---- build (collective) ----
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            c = self.moe_config
            pc = c.moe_parallel_config
            w13 = layer.w13_weight
            cfg = self.megamoe_config or config_for(w13.dtype, output_scale=self.output_scale)
            weights = weights_from_params(w13, layer.w2_weight, getattr(layer, "w13_weight_scale_inv", None),
                                          getattr(layer, "w2_weight_scale_inv", None))
            self.layer = build_layer(hidden=c.hidden_dim, intermediate=w13.shape[1] // 2, num_experts=c.num_experts,
                                     top_k=c.experts_per_token, ep_size=pc.ep_size, ep_rank=pc.ep_rank,
                                     max_tokens_per_rank=c.max_num_tokens, weights=weights, config=cfg,
                                     comm=comm_for(pc.ep_size, self.ep_group, self.ep_cpu_group))
            self.layer.warmup()

        # ---- forward ----
        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            if apply_router_weight_on_input:
                raise megamoe.InvalidArgumentError(
                    "invalid argument: apply_router_weight_on_input=True, megamoe applies the router weights "
                    "to the expert outputs (set it False)")
            if self.layer is None:
                raise megamoe.FailedPreconditionError(
                    "MegaMoEExperts.apply() before process_weights_after_loading(): the megamoe layer is built "
                    "and warmed up there (collective, every EP rank, before CUDA-graph capture)")
            self.layer(hidden_states, topk_ids, topk_weights, out=output, x_scale=a1q_scale)
            return None

    return MegaMoEExperts


def __getattr__(name):
    if name == "MegaMoEExperts":
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: PLC0415
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: PLC0415
            TopKWeightAndReduceNoOP,
        )

        cls = experts_class(mk, TopKWeightAndReduceNoOP)
        globals()[name] = cls
        return cls
    raise AttributeError(name)
