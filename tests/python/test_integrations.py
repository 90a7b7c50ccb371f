"""The engine adapters against stand-ins of vLLM's, SGLang's and TensorRT-LLM's interfaces, and against
the engines' real classes where the engine imports (skipped with the reason otherwise). Each drives the
engine's call order and checks the layer's output, on the CPU, against a float64 torch reference of the
same experts. Tensors live where an engine keeps them: on the device `auto` builds the layer for (a
Hopper GPU: mega or routed on cuda:0, weights and activations there too; no GPU: the cpu backend and
CPU tensors, as in CI)."""
import importlib.metadata
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the adapters need torch")

import megamoe  # noqa: E402
import megamoe.torch as mt  # noqa: E402
from megamoe import _C  # noqa: E402
from megamoe.integrations import sglang as sg  # noqa: E402
from megamoe.integrations import trtllm as trt  # noqa: E402
from megamoe.integrations import vllm as vl  # noqa: E402
import engine_standins as st  # noqa: E402

H, I, E, K, T = 256, 128, 8, 2, 12
BOUND = _C._error_bound(megamoe.MoeConfig(weight_format="bf16", dispatch_format="bf16"), K)[0]


def _auto_backend():
    """The backend `auto` picks for these layers (the adapters build with auto) and its device."""
    g = megamoe.MoeGeometry(hidden=H, intermediate=I, num_experts=E, top_k=K, ep_size=1, ep_rank=0,
                            max_tokens_per_rank=32)
    backend, _ = megamoe.select_backend(g, megamoe.MoeConfig(weight_format="bf16", dispatch_format="bf16"))
    return backend, torch.device("cpu") if backend == megamoe.Backend.cpu else torch.device("cuda", 0)


BACKEND, DEV = _auto_backend()


@pytest.fixture(autouse=True)
def _release_layers():
    yield
    mt.destroy_all()


def expert_weights(seed):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    return w13, w2


def reference(x, w13, w2, ids, weights):
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    y = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t]
            y[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    return y


def rel(a, b):
    """rel-L2 of the layer's output `a` (on any device) against the float64 CPU reference `b`."""
    assert a.device == DEV, f"output on {a.device}, expected the layer's device {DEV}"
    a = a.double().cpu()
    return float((a - b).norm() / b.norm())


def on_dev(*ts):
    return tuple(t.to(DEV) for t in ts)


def assert_built_on_dev(layer):
    assert layer.backend == BACKEND and layer.device == DEV, (layer, BACKEND, DEV)


def routing(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return x, logits, ids.to(torch.int32), w


# ---- vLLM ----

def vllm_experts(**kw):
    cls = vl.experts_class(st.vllm_modular_kernel, st.TopKWeightAndReduceNoOP)
    cfg = st.FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size_per_partition=I,
                            num_local_experts=E, moe_parallel_config=st.FusedMoEParallelConfig(), max_num_tokens=32)
    return cls(cfg, quant_config=None, **kw)


def test_vllm_modular_kernel_with_passthrough_prepare_finalize():
    w13, w2 = expert_weights(1)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(w13.to(DEV), requires_grad=False)  # the engine holds them on the device
    layer.w2_weight = torch.nn.Parameter(w2.to(DEV), requires_grad=False)
    experts = vllm_experts(output_scale=2.0)
    assert experts.expects_unquantized_inputs and experts.activation_format() == st.FusedMoEActivationFormat.Standard
    assert experts.workspace_shapes(7, 2 * I, H, K, E, E, None, "silu") == ((0,), (0,), (7, H))
    assert not inspect.isabstract(type(experts))
    experts.process_weights_after_loading(layer)  # builds and warms up
    assert_built_on_dev(experts.layer)
    kernel = st.FusedMoEModularKernel(st.PassThroughPrepareAndFinalize(), experts)
    x, _, ids, w = routing(2)
    ids[3, 1] = -1  # a padded slot
    dx, dids, dw = on_dev(x, ids, w)
    y = kernel.forward(dx, layer.w13_weight, layer.w2_weight, dw, dids, E)
    assert rel(y, 2.0 * reference(x, w13, w2, ids, w)) < BOUND
    y64 = kernel.forward(dx, layer.w13_weight, layer.w2_weight, dw, dids.to(torch.int64), E)
    assert torch.equal(y64.view(torch.int16), y.view(torch.int16))


def test_vllm_apply_before_build_and_router_weight_on_input_are_refused():
    experts = vllm_experts()
    x, _, ids, w = routing(3)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    with pytest.raises(megamoe.FailedPreconditionError, match="before process_weights_after_loading"):
        experts.apply(out, x, None, None, w, ids, "silu", E, None, None, None, None, None, None, False)
    with pytest.raises(megamoe.InvalidArgumentError, match="apply_router_weight_on_input=True"):
        experts.apply(out, x, None, None, w, ids, "silu", E, None, None, None, None, None, None, True)


def test_vllm_real_classes():
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    cls = vl.MegaMoEExperts
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    assert issubclass(cls, mk.FusedMoEExpertsModular) and not inspect.isabstract(cls)


# ---- SGLang ----

def test_sglang_provider_registers_and_runs_a_layer():
    registry = st.A2AProviderRegistry()
    assert sg.register(registry) is True
    provider_cls = registry.providers["megamoe"]
    method, dispatcher_cls = provider_cls().prepare_layer(
        num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, ep_size=1, ep_rank=0, max_tokens_per_rank=32,
        params_dtype=torch.bfloat16, routed_scaling_factor=2.5)
    layer = torch.nn.Module()
    with DEV:  # the engine's model loader builds its modules on the target device
        method.create_weights(layer)
    assert layer.w13_weight.shape == (E, 2 * I, H) and layer.w2_weight.shape == (E, H, I)
    assert layer.w13_weight.device == DEV
    w13, w2 = expert_weights(4)
    layer.w13_weight.data.copy_(w13)  # the engine's weight loader
    layer.w2_weight.data.copy_(w2)
    method.process_weights_after_loading(layer)
    assert_built_on_dev(method.layer)
    x, logits, ids, w = routing(5)
    dispatcher = dispatcher_cls()
    d = dispatcher.dispatch(*on_dev(x), st.StandardTopKOutput(*on_dev(w, ids, logits)))
    y = dispatcher.combine(st.StandardCombineInput(method.apply(layer, d)))
    assert rel(y, 2.5 * reference(x, w13, w2, ids, w)) < BOUND  # routed_scaling_factor applied once


def test_sglang_entry_point_is_declared():
    eps = importlib.metadata.entry_points()
    group = eps.select(group="sglang.plugins") if hasattr(eps, "select") else eps.get("sglang.plugins", [])
    assert {ep.name: ep.value for ep in group}.get("megamoe") == "megamoe.integrations.sglang:register"


def test_sglang_real_registry():
    pytest.importorskip("sglang", reason="SGLang is not installed here")
    assert sg.register() in (True, False)  # False is logged when this SGLang has no provider registry


# ---- TensorRT-LLM ----

def test_trtllm_backend_loads_builds_and_forwards():
    cls = trt.moe_class(st.MoE)
    routing_method = st.RenormalizeMoeRoutingMethod(K)
    moe = cls(routing_method=routing_method, num_experts=E, hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
              model_config=st.ModelConfig(max_num_tokens=32))
    with DEV:  # the engine materialises its modules' parameters on the device
        moe.create_weights()
    assert moe.w13_weight.device == DEV
    w13, w2 = expert_weights(6)
    ckpt = {}
    for e in range(E):
        ckpt[f"{e}.w1.weight"], ckpt[f"{e}.w3.weight"], ckpt[f"{e}.w2.weight"] = w13[e, :I], w13[e, I:], w2[e]
    moe.load_weights([ckpt])
    with pytest.raises(megamoe.FailedPreconditionError, match="before post_load_weights"):
        moe.forward_impl(torch.zeros(1, H, dtype=torch.bfloat16, device=DEV), torch.zeros(1, E, device=DEV))
    moe.post_load_weights()
    assert_built_on_dev(moe.megamoe_layer)
    x, logits, _, _ = routing(7)
    y = moe(*on_dev(x, logits))
    ids, w = routing_method.apply(logits)
    assert rel(y, reference(x, w13, w2, ids, w)) < BOUND
    fake = moe.forward_fake(*on_dev(x, logits))
    assert fake.shape == y.shape and fake.dtype == torch.bfloat16


def test_trtllm_can_implement_says_why_not():
    ok, why = trt.can_implement(None, torch.bfloat16, hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                ep_size=1, sm_version=100)
    assert not ok and "sm_100" in why
    ok, why = trt.can_implement("NVFP4", torch.bfloat16, hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                ep_size=1, sm_version=90)
    assert not ok and "quant_algo=NVFP4" in why
    ok, why = trt.can_implement(None, torch.bfloat16, hidden_size=2880, intermediate_size=I, num_experts=E, top_k=K,
                                ep_size=1, sm_version=90)
    assert not ok and "hidden=2880, must be a multiple of 128" in why
    ok, why = trt.can_implement(None, torch.float16, hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                ep_size=1, sm_version=90)
    assert not ok and "bfloat16" in why


def test_trtllm_real_classes():
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed here")
    cls = trt.MegaMoE
    from tensorrt_llm._torch.modules.fused_moe.interface import MoE

    assert issubclass(cls, MoE)
