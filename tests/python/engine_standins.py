"""Stand-ins of the engine interfaces the adapters plug into, with the engines' names, signatures and call
order (read from vLLM's fused_moe/modular_kernel.py and config.py, TensorRT-LLM's
_torch/modules/fused_moe/interface.py and routing, and SGLang's plugin loader), small enough to run
in CI without the engines. Only what the adapters touch is here.
"""
from __future__ import annotations

import enum
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from math import prod

import torch


# ---------------------------------------------------------------------------------------------- vLLM
class FusedMoEActivationFormat(enum.Enum):
    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


@dataclass
class FusedMoEParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    use_ep: bool = False
    all2all_backend: str = "passthrough"


@dataclass
class FusedMoEConfig:
    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size_per_partition: int
    num_local_experts: int
    moe_parallel_config: FusedMoEParallelConfig
    in_dtype: torch.dtype = torch.bfloat16
    activation: str = "silu"
    max_num_tokens: int = 64


class TopKWeightAndReduce(ABC):
    @abstractmethod
    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        raise NotImplementedError


class TopKWeightAndReduceNoOP(TopKWeightAndReduce):
    """The experts already weighted and reduced: copy into `output` if it is another tensor."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        if output is None:
            return fused_expert_output
        if output.data_ptr() != fused_expert_output.data_ptr():
            output.copy_(fused_expert_output)
        return output


class FusedMoEExperts(ABC):
    def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None):
        if self.activation_format() == FusedMoEActivationFormat.Standard and (
                max_num_tokens is not None or num_dispatchers is not None):
            raise ValueError("max_num_tokens and num_dispatchers should only be set for BatchedExperts")
        self.moe_config = moe_config
        self.quant_config = quant_config

    def process_weights_after_loading(self, layer):  # noqa: B027
        pass

    @property
    def expects_unquantized_inputs(self) -> bool:
        return False

    @staticmethod
    @abstractmethod
    def activation_format():
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def _supports_current_device() -> bool:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def _supports_no_act_and_mul() -> bool:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def _supports_activation(activation) -> bool:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        raise NotImplementedError


class FusedMoEExpertsModular(FusedMoEExperts):
    @staticmethod
    def is_monolithic() -> bool:
        return False

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        E, N, _ = w1.shape
        return E, a1.size(0), N, a1.size(-1), topk_ids.size(1)

    @abstractmethod
    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        raise NotImplementedError

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        raise NotImplementedError

    @abstractmethod
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        raise NotImplementedError


class PassThroughPrepareAndFinalize:
    """Hidden states stay on their rank (the experts do the all-to-all); the output is already reduced."""

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant):
        assert defer_input_quant, "megamoe expects unquantised inputs"
        return a1, None, None, None, None

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        weight_and_reduce_impl.apply(output, fused_expert_output, topk_weights, topk_ids,
                                     apply_router_weight_on_input)

    def output_is_reduced(self) -> bool:
        return True


class FusedMoEModularKernel:
    """prepare -> workspace_shapes -> buffers -> experts.apply -> finalize, as vLLM's modular kernel."""

    def __init__(self, prepare_finalize, fused_experts):
        self.prepare_finalize = prepare_finalize
        self.fused_experts = fused_experts

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts):
        fe = self.fused_experts
        a1q, a1q_scale, meta, _, _ = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, None, False, fe.quant_config,
            defer_input_quant=fe.expects_unquantized_inputs)
        _, M, N, K, top_k = fe.moe_problem_size(a1q, w1, w2, topk_ids)
        ws13, ws2, out_shape = fe.workspace_shapes(M, N, K, top_k, global_num_experts,
                                                   fe.moe_config.num_local_experts, meta, "silu")
        dt = hidden_states.dtype
        workspace13 = torch.empty(prod(ws13), dtype=dt, device=a1q.device)
        workspace2 = torch.empty(prod(ws2), dtype=dt, device=a1q.device)
        fused_out = torch.empty(out_shape, dtype=dt, device=a1q.device)
        fe.apply(fused_out, a1q, w1, w2, topk_weights, topk_ids, "silu", global_num_experts, None, a1q_scale,
                 None, workspace13, workspace2, meta, False)
        output = torch.empty_like(hidden_states)
        self.prepare_finalize.finalize(output, fused_out, topk_weights, topk_ids, False,
                                       fe.finalize_weight_and_reduce_impl())
        return output


vllm_modular_kernel = types.SimpleNamespace(
    FusedMoEActivationFormat=FusedMoEActivationFormat, FusedMoEExpertsModular=FusedMoEExpertsModular,
    FusedMoEModularKernel=FusedMoEModularKernel)


# -------------------------------------------------------------------------------------- TensorRT-LLM
@dataclass
class Mapping:
    rank: int = 0
    tp_size: int = 1
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    moe_ep_size: int = 1
    moe_ep_rank: int = 0
    moe_cluster_size: int = 1
    moe_cluster_rank: int = 0
    enable_attention_dp: bool = True


@dataclass
class QuantConfig:
    quant_algo: str = None


@dataclass
class ModelConfig:
    mapping: Mapping = field(default_factory=Mapping)
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    moe_backend: str = "MEGAMOE"
    max_num_tokens: int = 64


class RenormalizeMoeRoutingMethod:
    """softmax over the top-k logits: (int32 ids, fp32 weights), as TensorRT-LLM's routing methods return."""

    def __init__(self, top_k: int):
        self.top_k = top_k

    @property
    def experts_per_token(self) -> int:
        return self.top_k

    def apply(self, router_logits):
        values, ids = torch.topk(router_logits.float(), self.top_k, dim=-1)
        return ids.to(torch.int32), torch.softmax(values, dim=-1)


class MoE(torch.nn.Module):
    """TensorRT-LLM's MoE interface: constructor fields the backends read."""

    def __init__(self, *, routing_method, num_experts, hidden_size, intermediate_size, dtype=None,
                 reduce_results=False, model_config=None, weight_loading_mode=None):
        super().__init__()
        model_config = model_config or ModelConfig()
        self.routing_method = routing_method
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.dtype = dtype
        self.reduce_results = reduce_results
        self.quant_config = model_config.quant_config
        m = model_config.mapping
        self.tp_size, self.tp_rank = m.moe_tp_size, m.moe_tp_rank
        self.ep_size, self.ep_rank = m.moe_ep_size, m.moe_ep_rank
        self.mapping = m

    @abstractmethod
    def create_weights(self):
        raise NotImplementedError

    @abstractmethod
    def load_weights(self, weights):
        raise NotImplementedError


# -------------------------------------------------------------------------------------------- SGLang
class A2AProviderRegistry:
    """What SGLang's customized a2a backend looks providers up in (name -> provider class)."""

    def __init__(self):
        self.providers = {}

    def register_moe_a2a_provider(self, name, provider):
        self.providers[name] = provider


@dataclass
class StandardTopKOutput:
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


@dataclass
class StandardCombineInput:
    hidden_states: torch.Tensor
