"""The torch tier: megamoe.torch wherever torch imports (skipped without it; CI runs numpy only).

On the cpu backend (CPU tensors, any machine with torch): the layer against the numpy layer, the
ops' opcheck, torch.compile(fullgraph=True), the registry. On a Hopper GPU (routed backend): against
the cpu backend, int64 ids converted on the device, CUDA-graph capture and replay equal to eager, a
forward under capture before warmup(), the host overhead of the Python forward over the C++ one, and
the captured kernel nodes of both.
"""
import os
import statistics
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch tier runs where torch imports")

import megamoe  # noqa: E402
import megamoe.torch as mt  # noqa: E402
from megamoe import _C  # noqa: E402
from moe_problem import BF16, make_problem, reference, rel_l2  # noqa: E402


def to_torch(a, device="cpu"):
    if a is None:
        return None
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    if str(a.dtype) == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(device)
    return torch.from_numpy(a.copy()).to(device)


def geometry(p, max_tokens=32, rank=0):
    return megamoe.MoeGeometry(hidden=p.hidden, intermediate=p.intermediate, num_experts=p.num_experts,
                               top_k=p.top_k, ep_size=p.ep_size, ep_rank=rank, max_tokens_per_rank=max_tokens)


def cpu_config(**kw):
    return megamoe.MoeConfig(backend="cpu", weight_format="bf16", dispatch_format="bf16", **kw)


def torch_weights(p, device="cpu"):
    w13, w2, s13, s2 = p.rank_weights(0)
    return megamoe.MoeWeights(to_torch(w13, device), to_torch(w2, device), to_torch(s13, device),
                              to_torch(s2, device))


@pytest.fixture(autouse=True)
def _no_leftover_layers():
    yield
    mt.destroy_all()


# ---- cpu backend, CPU tensors ----

def test_torch_layer_equals_numpy_layer_bitwise():
    p = make_problem(seed=40, tokens=(19,), minus_one_every=6)
    with megamoe.MoeLayer(geometry(p), megamoe.MoeWeights(*p.rank_weights(0)[:2]), cpu_config()) as host:
        want = host.forward(p.x[0], p.ids[0], p.weights[0])
    layer = mt.MoeLayer(geometry(p), torch_weights(p), cpu_config()).warmup()
    x, ids, w = to_torch(p.x[0]), to_torch(p.ids[0]), to_torch(p.weights[0])
    y = layer(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == (19, p.hidden)
    np.testing.assert_array_equal(y.view(torch.int16).numpy().view(np.uint16), want.view(np.uint16))
    y64 = layer(x, ids.to(torch.int64), w)
    assert torch.equal(y64.view(torch.int16), y.view(torch.int16))
    via_op = torch.ops.megamoe.forward(layer.handle, x, None, ids, w)  # the traced path; eager calls skip the op
    assert torch.equal(via_op.view(torch.int16), y.view(torch.int16))
    wb = w.to(torch.bfloat16)
    assert torch.equal(layer(x, ids, wb).view(torch.int16), layer(x, ids, wb.float()).view(torch.int16))
    out = torch.full_like(y, float("nan"))
    assert layer(x, ids, w, out=out) is out and torch.equal(out.view(torch.int16), y.view(torch.int16))
    assert rel_l2(y.float().numpy(), reference(p, 0)) < _C._error_bound(cpu_config(), p.top_k)[0]


def test_opcheck_forward_and_forward_out():
    p = make_problem(seed=41, tokens=(6,))
    layer = mt.MoeLayer(geometry(p, 8), torch_weights(p), cpu_config()).warmup()
    x, ids, w = to_torch(p.x[0]), to_torch(p.ids[0]), to_torch(p.weights[0])
    torch.library.opcheck(torch.ops.megamoe.forward.default, (layer.handle, x, None, ids, w))
    out = torch.empty((6, p.hidden), dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.megamoe.forward_out.default, (layer.handle, x, None, ids, w, out))


def test_torch_compile_fullgraph_traces_through_the_ops():
    p = make_problem(seed=42, tokens=(9,))
    layer = mt.MoeLayer(geometry(p), torch_weights(p), cpu_config()).warmup()
    x, ids, w = to_torch(p.x[0]), to_torch(p.ids[0]).to(torch.int64), to_torch(p.weights[0])

    def block(x, ids, w):
        out = torch.empty((x.shape[0], p.hidden), dtype=torch.bfloat16)
        layer(x, ids, w, out=out)
        return layer(x, ids, w).float() + out.float()

    eager = block(x, ids, w)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, ids, w), eager)


def test_registry_keeps_creation_order_and_handles_die_with_their_layer():
    p = make_problem(seed=43, tokens=(4,))
    made = [mt.MoeLayer(geometry(p), torch_weights(p), cpu_config()) for _ in range(3)]
    assert mt.layers() == made
    mt.warmup_all()
    handle = made[1].handle
    made[1].release()
    assert mt.layers() == [made[0], made[2]]
    with pytest.raises(megamoe.FailedPreconditionError, match=f"handle {handle} is not live"):
        torch.ops.megamoe.forward(handle, to_torch(p.x[0]), None, to_torch(p.ids[0]), to_torch(p.weights[0]))
    mt.destroy_all()
    assert mt.layers() == []


def test_error_pending_on_the_cpu_backend_and_after_release():
    p = make_problem(seed=45, tokens=(4,))
    layer = mt.MoeLayer(geometry(p), torch_weights(p), cpu_config()).warmup()
    layer(to_torch(p.x[0]), to_torch(p.ids[0]), to_torch(p.weights[0]))
    assert layer.error_pending() is False
    layer.release()
    with pytest.raises(megamoe.FailedPreconditionError, match=r"error_pending\(\) after release\(\)"):
        layer.error_pending()


def test_expert_counts_from_torch():
    p = make_problem(seed=44, tokens=(15,), minus_one_every=4)
    layer = mt.MoeLayer(geometry(p), torch_weights(p), cpu_config()).warmup()
    counts = torch.zeros(p.num_experts, dtype=torch.int64)
    layer.set_expert_counts(counts)
    layer(to_torch(p.x[0]), to_torch(p.ids[0]), to_torch(p.weights[0]))
    truth = np.bincount(p.ids[0][p.ids[0] >= 0], minlength=p.num_experts)
    np.testing.assert_array_equal(counts.numpy(), truth)


# ---- routed backend on a Hopper GPU ----

def _hopper_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability(0) != (9, 0):
        return f"the kernels are built for sm_90a; device 0 is {torch.cuda.get_device_name(0)}"
    return ""


gpu = pytest.mark.skipif(bool(_hopper_reason()), reason=_hopper_reason() or "ok")


def routed_config(**kw):
    return megamoe.MoeConfig(backend="routed", **kw)


def gpu_problem(seed, tokens=48):
    return make_problem(seed=seed, hidden=512, intermediate=256, num_experts=16, top_k=4, tokens=(tokens,),
                        minus_one_every=9)


def gpu_inputs(p, dev="cuda"):
    return to_torch(p.x[0], dev), to_torch(p.ids[0], dev), to_torch(p.weights[0], dev)


@gpu
def test_routed_from_torch_matches_cpu_backend():
    p = gpu_problem(50)
    cfg = dict(weight_format="fp8-block", dispatch_format="fp8-block")
    routed = mt.MoeLayer(geometry(p, 64), torch_weights(p), routed_config(**cfg)).warmup()
    assert routed.backend == megamoe.Backend.routed and routed.device.type == "cuda"
    cpu = mt.MoeLayer(geometry(p, 64), torch_weights(p), megamoe.MoeConfig(backend="cpu", **cfg)).warmup()
    x, ids, w = gpu_inputs(p)
    y = routed(x, ids, w)
    assert routed.error_pending() is False  # healthy, and no host sync
    routed.check_error()
    torch.cuda.synchronize()
    assert [routed.error_pending() for _ in range(3)] == [False] * 3  # the snapshots are in: still nothing
    want = cpu(x.cpu(), ids.cpu(), w.cpu())
    err = rel_l2(y.float().cpu().numpy(), want.float().numpy())
    bound = _C._same_points_bound(megamoe.CombineDtype.bf16)
    print(f"routed vs cpu backend from torch: rel_l2 {err:.3e} (bound {bound:.1e})")
    assert err < bound
    y64 = routed(x, ids.to(torch.int64), w)  # converted on the device
    assert torch.equal(y64.view(torch.int16), y.view(torch.int16))
    wb = w.to(torch.bfloat16)
    assert torch.equal(routed(x, ids, wb).view(torch.int16), routed(x, ids, wb.float()).view(torch.int16))


@gpu
def test_graph_capture_before_warmup_says_to_warm_up():
    p = gpu_problem(51)
    layer = mt.MoeLayer(geometry(p, 64), torch_weights(p), routed_config())
    x, ids, w = gpu_inputs(p)
    out = torch.empty((x.shape[0], p.hidden), dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(megamoe.FailedPreconditionError, match="call warmup\\(\\) on every rank first"):
        with torch.cuda.graph(g):
            layer(x, ids, w, out=out)


@gpu
@pytest.mark.parametrize("weight_format", ["fp8-block", "bf16"])
def test_cuda_graph_replay_equals_eager(weight_format):
    p = gpu_problem(52)
    layer = mt.MoeLayer(geometry(p, 64), torch_weights(p),
                        routed_config(weight_format=weight_format, dispatch_format=weight_format))
    mt.warmup_all()
    x, ids, w = gpu_inputs(p)
    ids64 = ids.to(torch.int64)
    eager = layer(x, ids64, w)
    out = torch.full_like(eager, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x, ids64, w, out=out)  # side-stream warm-up call, as torch's graph recipe does
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer(x, ids64, w, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    layer.check_error()


@gpu
def test_torch_compile_fullgraph_on_the_gpu():
    p = gpu_problem(53)
    layer = mt.MoeLayer(geometry(p, 64), torch_weights(p), routed_config()).warmup()
    x, ids, w = gpu_inputs(p)

    def block(x, ids, w):
        return layer(x, ids.to(torch.int64), w) * 2

    eager = block(x, ids, w)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=os.environ.get("MEGAMOE_TEST_COMPILE_BACKEND", "inductor"))
    assert torch.equal(compiled(x, ids, w).view(torch.int16), eager.view(torch.int16))


def _host_times_us(fn, calls=400, every=20):
    """Median host time of one call, syncing every `every` calls so the launch queue never fills."""
    times = []
    for i in range(calls):
        if i % every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times[every:]) / 1000.0


@gpu
def test_host_overhead_of_the_python_forward():
    p = gpu_problem(54, tokens=8)
    layer = mt.MoeLayer(geometry(p, 64), torch_weights(p), routed_config()).warmup()
    x, ids, w = gpu_inputs(p)
    out = torch.empty((x.shape[0], p.hidden), dtype=torch.bfloat16, device="cuda")
    views = [mt.tensor_view(t) for t in (x, ids, w, out)]
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(20):
        layer(x, ids, w, out=out)
    torch.cuda.synchronize()
    cpp = []
    for _ in range(20):
        torch.cuda.synchronize()
        cpp.extend(layer._impl._time_forward(*views, stream, None, 20)[1:])
    torch.cuda.synchronize()
    cpp_us = statistics.median(cpp) / 1000.0
    out_us = _host_times_us(lambda: layer(x, ids, w, out=out))
    alloc_us = _host_times_us(lambda: layer(x, ids, w))
    raw_us = _host_times_us(lambda: layer._run(x, None, ids, w, out))
    print(f"host time per forward: C++ {cpp_us:.2f} us; Python forward_out {out_us:.2f} us (+{out_us - cpp_us:.2f}); "
          f"Python forward {alloc_us:.2f} us (+{alloc_us - cpp_us:.2f}); Python without the op {raw_us:.2f} us "
          f"(+{raw_us - cpp_us:.2f})")
    assert out_us - cpp_us <= float(os.environ.get("MEGAMOE_TEST_OVERHEAD_US", "10"))


@gpu
def test_captured_python_forward_has_the_cpp_kernel_nodes():
    p = gpu_problem(55)
    layer = mt.MoeLayer(geometry(p, 64), torch_weights(p), routed_config()).warmup()
    x, ids, w = gpu_inputs(p)
    out = torch.empty((x.shape[0], p.hidden), dtype=torch.bfloat16, device="cuda")
    layer(x, ids, w, out=out)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    cpp_nodes = layer._impl._captured_forward_nodes(*[mt.tensor_view(t) for t in (x, ids, w, out)], s.cuda_stream,
                                                    None)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        layer(x, ids, w, out=out)
    py_nodes = _C._graph_nodes(g.raw_cuda_graph())
    print(f"kernel nodes: C++ {len(cpp_nodes)}, Python {len(py_nodes)}: {cpp_nodes}")
    assert sorted(py_nodes) == sorted(cpp_nodes)
    assert len(cpp_nodes) >= 5
