"""megamoe.torch with device-resident weights (torch tier, Hopper GPU; skipped without torch or one).

The layer hands CUDA weight tensors straight to the C++ layer, which prepares them on the device (no
host copy: the fallback is made to fail here): fp8-block (e4m3 + fp32 128x128 scales), bf16, and
bf16 quantised into fp8-block, each BITWISE the output of the layer built from the same tensors on
the host, and expert_weight_views() alias the same prepared bytes on both (an expert swap through
them keeps the outputs equal). For a format the device path refuses, the device tensors go through
the host (the fallback) with the same output. Each case runs in a fresh Python process (check()
replaces megamoe.torch's host copy to make the fallback fail, and leaves it replaced).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch tier runs where torch imports")

import megamoe  # noqa: E402
import megamoe.torch as mt  # noqa: E402
from moe_problem import BF16, make_problem  # noqa: E402


def _hopper_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability(0) != (9, 0):
        return f"the kernels are built for sm_90a; device 0 is {torch.cuda.get_device_name(0)}"
    return ""


gpu = pytest.mark.skipif(bool(_hopper_reason()), reason=_hopper_reason() or "ok")


def _to_torch(a, device):
    if a is None:
        return None
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    if str(a.dtype) == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(device)
    return torch.from_numpy(a.copy()).to(device)


def check(backend: str, source: str, weight_format: str, expect_via_host: bool) -> None:
    """One case, in this process: the layer from CUDA tensors against the layer from CPU tensors."""
    p = make_problem(seed=61, hidden=512, intermediate=256, num_experts=16, top_k=4, tokens=(40,),
                     fp8=source == "fp8", minus_one_every=7)
    g = megamoe.MoeGeometry(hidden=p.hidden, intermediate=p.intermediate, num_experts=p.num_experts,
                            top_k=p.top_k, ep_size=1, ep_rank=0, max_tokens_per_rank=64)
    dispatch = "bf16" if weight_format == "bf16" else "fp8-block"
    cfg = megamoe.MoeConfig(backend=backend, weight_format=weight_format, dispatch_format=dispatch)
    w13, w2, s13, s2 = p.rank_weights(0)
    if source == "fp32":  # a host conversion on every path (weights.h): the device path refuses it
        w13, w2 = w13.astype(np.float32), w2.astype(np.float32)

    def weights(device):
        return mt.MoeWeights(*(_to_torch(a, device) for a in (w13, w2, s13, s2)))

    host = mt.MoeLayer(g, weights("cpu"), cfg).warmup()
    assert host.weights_via_host is False
    if not expect_via_host:
        def no_host_copy(t):
            raise AssertionError("device weights went through the host")
        mt._host_copy = no_host_copy
    dev = mt.MoeLayer(g, weights("cuda"), cfg).warmup()
    assert dev.weights_via_host is expect_via_host, (dev.weights_via_host, expect_via_host)
    assert dev.backend == getattr(megamoe.Backend, backend)
    x = _to_torch(p.x[0], "cuda")
    ids = _to_torch(p.ids[0], "cuda")
    tw = _to_torch(p.weights[0], "cuda")
    xs = _to_torch(p.x_scale[0], "cuda")  # an e4m3 x (the fp8 problem) comes with its 1x128 scales
    want, got = host(x, ids, tw, x_scale=xs), dev(x, ids, tw, x_scale=xs)
    torch.cuda.synchronize()
    differ = int((want.view(torch.int16) != got.view(torch.int16)).sum())
    print(f"{backend} {source}->{weight_format} via_host={expect_via_host}: {differ} elements differ")
    assert differ == 0
    # The per-expert views alias the same prepared bytes on both layers; swapping experts 2 and 5
    # through them (EPLB's move) changes both outputs alike.
    hv, dv = host.expert_weight_views(), dev.expert_weight_views()
    assert len(hv) == len(dv) == p.num_experts
    names = {"w13", "w2"} | ({"w13_scale", "w2_scale"} if weight_format == "fp8-block" else set())
    for e in range(p.num_experts):
        assert set(hv[e]) == set(dv[e]) == names
        for n in names:
            assert hv[e][n].dtype == torch.uint8 and hv[e][n].device == dev.device
            assert torch.equal(hv[e][n], dv[e][n]), (e, n)
    for views in (hv, dv):
        for n in names:
            a, b = views[2][n], views[5][n]
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)
    want2, got2 = host(x, ids, tw, x_scale=xs), dev(x, ids, tw, x_scale=xs)
    torch.cuda.synchronize()
    assert not torch.equal(want2.view(torch.int16), want.view(torch.int16))
    assert torch.equal(want2.view(torch.int16), got2.view(torch.int16))
    dev.check_error()
    mt.destroy_all()


def _run(*args) -> None:
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    code = f"import test_torch_device_weights as t; t.check{args!r}"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr


@gpu
@pytest.mark.parametrize("backend", ["routed", "mega"])
@pytest.mark.parametrize("source,weight_format", [("fp8", "fp8-block"), ("bf16", "bf16"), ("bf16", "fp8-block")])
def test_device_weights_pass_straight_through(backend, source, weight_format):
    _run(backend, source, weight_format, False)


@gpu
def test_a_format_the_device_path_refuses_goes_through_the_host():
    # fp32 tensors are a host conversion (weights.h): refused on the device, copied to the host.
    _run("routed", "fp32", "fp8-block", True)
