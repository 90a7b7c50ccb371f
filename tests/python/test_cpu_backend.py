"""The cpu backend from Python: 1, 2 and 4 ranks as Python threads against a numpy float64 reference.

Each rank's thread builds its own layer on its handle of one host group, warms up and runs
forward(); the collectives inside only complete because the binding releases the GIL.
"""
import numpy as np
import pytest

import megamoe
from megamoe import _C
from moe_problem import BF16, make_problem, reference, rel_l2, run_ranks


def config(fp8, **kw):
    fmt = "fp8-block" if fp8 else "bf16"
    return megamoe.MoeConfig(backend="cpu", weight_format=fmt, dispatch_format=fmt, **kw)


def geometry(p, rank, max_tokens):
    return megamoe.MoeGeometry(hidden=p.hidden, intermediate=p.intermediate, num_experts=p.num_experts,
                               top_k=p.top_k, ep_size=p.ep_size, ep_rank=rank, max_tokens_per_rank=max_tokens)


def run(p, cfg, max_tokens=32, repeats=1, ids_dtype=np.int32):
    """Every rank's outputs (a list of `repeats` arrays per rank)."""
    comms = megamoe.host_group(p.ep_size) if p.ep_size > 1 else [None]

    def rank(r):
        w13, w2, s13, s2 = p.rank_weights(r)
        with megamoe.MoeLayer(geometry(p, r, max_tokens), megamoe.MoeWeights(w13, w2, s13, s2), cfg, comms[r]) as layer:
            assert layer.backend == megamoe.Backend.cpu and layer.device == "cpu"
            layer.warmup()
            outs = []
            for _ in range(repeats):
                y = np.full((p.x[r].shape[0], p.hidden), np.nan, dtype=BF16)  # poisoned: every row is written
                layer.forward(p.x[r], p.ids[r].astype(ids_dtype), p.weights[r], y, x_scale=p.x_scale[r])
                outs.append(y)
            return outs

    return run_ranks(p.ep_size, rank)


@pytest.mark.parametrize("ep_size", [1, 2, 4])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matches_float64_reference(ep_size, fp8):
    p = make_problem(seed=ep_size * 10 + fp8, ep_size=ep_size, tokens=(24, 7, 32, 1), fp8=fp8)
    cfg = config(fp8)
    bound, derivation = _C._error_bound(cfg, p.top_k)
    outs = run(p, cfg)
    for r in range(ep_size):
        got = outs[r][0].astype(np.float64)
        want = reference(p, r)
        err = rel_l2(got, want)
        print(f"EP{ep_size} {'fp8' if fp8 else 'bf16'} rank {r}: rel_l2 {err:.3e} (bound {bound:.3e}: {derivation})")
        assert np.isfinite(got).all()
        assert 0 < err < bound


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_repeats_are_bitwise_equal(ep_size):
    p = make_problem(seed=3, ep_size=ep_size, tokens=(20,))
    outs = run(p, config(False), repeats=3)
    for r in range(ep_size):
        first = outs[r][0].view(np.uint16)
        for y in outs[r][1:]:
            np.testing.assert_array_equal(y.view(np.uint16), first)


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_int64_ids_equal_int32_ids_bitwise(ep_size):
    p = make_problem(seed=4, ep_size=ep_size, tokens=(17,), minus_one_every=5)
    a = run(p, config(False), ids_dtype=np.int32)
    b = run(p, config(False), ids_dtype=np.int64)
    for r in range(ep_size):
        np.testing.assert_array_equal(a[r][0].view(np.uint16), b[r][0].view(np.uint16))


def test_zero_token_ranks_take_part():
    p = make_problem(seed=5, ep_size=4, tokens=(12, 0, 9, 0))
    outs = run(p, config(False))
    bound, _ = _C._error_bound(config(False), p.top_k)
    for r in range(4):
        assert outs[r][0].shape == (p.x[r].shape[0], p.hidden)
        if p.x[r].shape[0]:
            assert rel_l2(outs[r][0], reference(p, r)) < bound


def test_minus_one_slots_are_skipped():
    p = make_problem(seed=6, ep_size=2, tokens=(16,), minus_one_every=3)
    p.ids[0][5, :] = -1  # a token with no expert at all: y = 0
    outs = run(p, config(False))
    bound, _ = _C._error_bound(config(False), p.top_k)
    for r in range(2):
        assert rel_l2(outs[r][0], reference(p, r)) < bound
    np.testing.assert_array_equal(outs[0][0][5].astype(np.float32), np.zeros(p.hidden, np.float32))


def test_max_tokens_per_rank_exactly():
    p = make_problem(seed=7, ep_size=2, tokens=(32, 32))
    outs = run(p, config(False), max_tokens=32)
    bound, _ = _C._error_bound(config(False), p.top_k)
    assert all(rel_l2(outs[r][0], reference(p, r)) < bound for r in range(2))


def test_forward_allocates_the_output_when_not_given():
    p = make_problem(seed=8, tokens=(5,))
    w13, w2, _, _ = p.rank_weights(0)
    with megamoe.MoeLayer(geometry(p, 0, 8), megamoe.MoeWeights(w13, w2), config(False)) as layer:
        y = layer(p.x[0], p.ids[0], p.weights[0])
        assert y.dtype == BF16 and y.shape == (5, p.hidden)
        assert rel_l2(y, reference(p, 0)) < _C._error_bound(config(False), p.top_k)[0]


def test_bf16_weights_and_output_scale():
    p = make_problem(seed=14, ep_size=2, tokens=(16, 9))
    for r in range(2):
        p.weights[r] = p.weights[r].astype(BF16).astype(np.float32)  # bf16 holds these exactly
    want = run(p, config(False))
    as_bf16 = make_problem(seed=14, ep_size=2, tokens=(16, 9))
    as_bf16.weights = [w.astype(BF16) for w in p.weights]
    got = run(as_bf16, config(False))
    for r in range(2):
        np.testing.assert_array_equal(got[r][0].view(np.uint16), want[r][0].view(np.uint16))
    # output_scale s: the forward with the weights fp32(s * w), bit for bit
    s = np.float32(2.5)
    scaled = run(p, config(False, output_scale=float(s)))
    prescaled = make_problem(seed=14, ep_size=2, tokens=(16, 9))
    prescaled.weights = [(s * w).astype(np.float32) for w in p.weights]
    want = run(prescaled, config(False))
    for r in range(2):
        np.testing.assert_array_equal(scaled[r][0].view(np.uint16), want[r][0].view(np.uint16))
        assert rel_l2(scaled[r][0], float(s) * reference(p, r)) < _C._error_bound(config(False), p.top_k)[0]


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_expert_counts_are_the_rows_each_local_expert_received(ep_size):
    p = make_problem(seed=15, ep_size=ep_size, tokens=(13, 0, 21, 5), minus_one_every=7)
    el = p.num_experts // ep_size
    truth = np.zeros(p.num_experts, np.int64)
    for ids in p.ids:
        np.add.at(truth, ids[ids >= 0], 1)
    comms = megamoe.host_group(ep_size) if ep_size > 1 else [None]

    def rank(r):
        w13, w2, _, _ = p.rank_weights(r)
        with megamoe.MoeLayer(geometry(p, r, 32), megamoe.MoeWeights(w13, w2), config(False), comms[r]) as layer:
            counts = np.zeros(el, np.int64)
            layer.set_expert_counts(counts)
            layer.forward(p.x[r], p.ids[r], p.weights[r])
            layer.forward(p.x[r], p.ids[r], p.weights[r])
            layer.set_expert_counts(None)
            layer.forward(p.x[r], p.ids[r], p.weights[r])
            return counts

    counts = run_ranks(ep_size, rank)
    for r in range(ep_size):
        np.testing.assert_array_equal(counts[r], 2 * truth[r * el:(r + 1) * el])


# ---- refusals, with the C++ messages ----

def one_rank_layer(p, max_tokens=8):
    w13, w2, _, _ = p.rank_weights(0)
    return megamoe.MoeLayer(geometry(p, 0, max_tokens), megamoe.MoeWeights(w13, w2), config(False))


def test_forward_refuses_bad_arguments_naming_them():
    p = make_problem(seed=9, tokens=(4,))
    with one_rank_layer(p) as layer:
        x, ids, w = p.x[0], p.ids[0], p.weights[0]
        with pytest.raises(megamoe.InvalidArgumentError) as info:
            layer.forward(x[:, :128].copy(), ids, w)
        assert str(info.value) == "invalid forward argument: x.shape[1]=128, must equal hidden=256"
        with pytest.raises(megamoe.InvalidArgumentError, match=r"x.shape\[0\]=9, T must be at most max_tokens_per_rank=8"):
            layer.forward(np.zeros((9, p.hidden), BF16), np.zeros((9, 4), np.int32), np.zeros((9, 4), np.float32))
        with pytest.raises(megamoe.InvalidArgumentError, match="topk_weights.dtype=float64, must be float32"):
            layer.forward(x, ids, w.astype(np.float64))
        with pytest.raises(megamoe.InvalidArgumentError, match="x.strides=non-contiguous, must be contiguous"):
            layer.forward(np.zeros((4, 2 * p.hidden), BF16)[:, ::2], ids, w)
        bad = ids.copy()
        bad[2, 1] = p.num_experts
        with pytest.raises(megamoe.InvalidArgumentError, match=r"topk_ids\[2, 1\]=8"):
            layer.forward(x, bad, w)


def test_weights_refusals_name_the_field():
    p = make_problem(seed=10, tokens=(4,))
    w13, w2, _, _ = p.rank_weights(0)
    with pytest.raises(megamoe.InvalidArgumentError, match=r"invalid weights: w2.shape=\[8, 256, 64\]"):
        megamoe.MoeLayer(geometry(p, 0, 8), megamoe.MoeWeights(w13, w2[:, :, :64].copy()), config(False))
    with pytest.raises(megamoe.InvalidArgumentError, match="w13.dtype"):
        megamoe.MoeLayer(geometry(p, 0, 8), megamoe.MoeWeights(w13.astype(np.float16), w2), config(False))


def test_ep2_without_a_communicator_is_refused():
    p = make_problem(seed=11, ep_size=2, tokens=(4,))
    w13, w2, _, _ = p.rank_weights(0)
    with pytest.raises(megamoe.InvalidArgumentError, match="comm=null, ep_size=2 needs a communicator"):
        megamoe.MoeLayer(geometry(p, 0, 8), megamoe.MoeWeights(w13, w2), config(False))


def test_a_rank_that_never_arrives_times_out_with_stage_and_peer(monkeypatch):
    p = make_problem(seed=12, ep_size=2, tokens=(4,))
    comms = megamoe.host_group(2)
    w13, w2, _, _ = p.rank_weights(0)
    layer = megamoe.MoeLayer(geometry(p, 0, 8), megamoe.MoeWeights(w13, w2), config(False), comms[0])
    with pytest.raises(megamoe.CommTimeoutError) as info:  # rank 1 never calls warmup()
        layer.warmup()
    assert isinstance(info.value, TimeoutError)
    assert "rank 0" in str(info.value) and "warmup" in str(info.value)


def test_released_layer_refuses_calls():
    p = make_problem(seed=13, tokens=(4,))
    layer = one_rank_layer(p)
    layer.release()
    layer.release()  # idempotent
    assert repr(layer) == "MoeLayer(released)"
    with pytest.raises(megamoe.FailedPreconditionError, match="the layer was destroyed"):
        layer.forward(p.x[0], p.ids[0], p.weights[0])
    with pytest.raises(megamoe.FailedPreconditionError, match=r"error_pending\(\) after release\(\)"):
        layer.error_pending()


def test_error_pending_is_false_on_the_cpu_backend():
    p = make_problem(seed=14, tokens=(4,))
    with one_rank_layer(p) as layer:
        assert layer.error_pending() is False  # before warmup
        layer.warmup()
        bad = p.ids[0].copy()
        bad[1, 0] = -2
        with pytest.raises(megamoe.InvalidArgumentError, match=r"topk_ids\[1, 0\]=-2"):
            layer.forward(p.x[0], bad, p.weights[0])
        assert layer.error_pending() is False  # forward() raised it itself: nothing left for check_error()
        layer.check_error()
        layer.forward(p.x[0], p.ids[0], p.weights[0])
        assert layer.error_pending() is False


def test_expert_weight_views_are_the_gpu_backends_only():
    p = make_problem(seed=15, tokens=(4,))
    with one_rank_layer(p) as layer:
        with pytest.raises(megamoe.UnavailableError, match="no device expert weights"):
            layer.expert_weight_views()
