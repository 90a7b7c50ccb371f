"""Random MoE problems and the float64 reference for the Python tests (numpy + ml_dtypes only).

The reference computes, per token t of a rank,
    y[t] = sum_j w[t, j] * W2_e @ (silu(W1g_e @ x_t) * (W1u_e @ x_t)),  e = ids[t, j] != -1
in float64 on the values the layer computes with: bf16 weights and x as given, or e4m3 codes times
their fp32 block scales (prepared as fp8-block bit for bit), so the only differences left are the
layer's roundings after FC1 (reference/error_model.h bounds them).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass
class Problem:
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    ep_size: int
    fp8: bool
    w13: np.ndarray  # [E, 2I, H] bf16 or e4m3 (all experts; rank r holds a slice)
    w2: np.ndarray  # [E, H, I]
    w13_scale: np.ndarray = None  # [E, 2I/128, H/128] fp32 (fp8)
    w2_scale: np.ndarray = None
    # per rank
    x: list = field(default_factory=list)  # [T, H] bf16 or e4m3
    x_scale: list = field(default_factory=list)  # [T, H/128] fp32 (fp8) or None
    ids: list = field(default_factory=list)  # [T, k] int32
    weights: list = field(default_factory=list)  # [T, k] fp32

    def rank_weights(self, r):
        el = self.num_experts // self.ep_size
        s = slice(r * el, (r + 1) * el)
        if self.fp8:
            return (self.w13[s], self.w2[s], self.w13_scale[s], self.w2_scale[s])
        return (self.w13[s], self.w2[s], None, None)


def _fp8_blocks(rng, shape, block_rows, block_cols):
    """e4m3 codes of random values and fp32 scales per (block_rows x block_cols) block."""
    values = rng.standard_normal(shape).astype(np.float32)
    codes = values.astype(E4M3)  # |v| < 448
    scale_shape = shape[:-2] + (shape[-2] // block_rows, shape[-1] // block_cols)
    scales = rng.uniform(0.005, 0.02, size=scale_shape).astype(np.float32)
    return codes, scales


def make_problem(seed, hidden=256, intermediate=128, num_experts=8, top_k=4, ep_size=1, tokens=(16,), fp8=False,
                 minus_one_every=0):
    rng = np.random.default_rng(seed)
    H, I, E, k = hidden, intermediate, num_experts, top_k
    if fp8:
        w13, s13 = _fp8_blocks(rng, (E, 2 * I, H), 128, 128)
        w2, s2 = _fp8_blocks(rng, (E, H, I), 128, 128)
        p = Problem(H, I, E, k, ep_size, True, w13, w2, s13, s2)
    else:
        w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(BF16)
        w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(BF16)
        p = Problem(H, I, E, k, ep_size, False, w13, w2)
    for r in range(ep_size):
        T = tokens[r] if r < len(tokens) else tokens[-1]
        if fp8:
            x, xs = _fp8_blocks(rng, (T, H), 1, 128)
            xs = (xs * 10).astype(np.float32)
        else:
            x, xs = rng.standard_normal((T, H)).astype(BF16), None
        ids = np.array([rng.permutation(E)[:k] for _ in range(T)], dtype=np.int32).reshape(T, k)
        if minus_one_every:
            ids.reshape(-1)[::minus_one_every] = -1
        w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
        p.x.append(x)
        p.x_scale.append(xs)
        p.ids.append(ids)
        p.weights.append(w)
    return p


def _dequant(codes, scales, block_rows, block_cols):
    v = codes.astype(np.float64)
    if scales is None:
        return v
    s = np.repeat(np.repeat(scales.astype(np.float64), block_rows, axis=-2), block_cols, axis=-1)
    return v * s


def reference(p: Problem, r: int) -> np.ndarray:
    """float64 y [T, H] of rank r's tokens."""
    I = p.intermediate
    w13 = _dequant(p.w13, p.w13_scale, 128, 128)
    w2 = _dequant(p.w2, p.w2_scale, 128, 128)
    x = _dequant(p.x[r], p.x_scale[r], 1, 128)
    ids, wts = p.ids[r], p.weights[r].astype(np.float64)
    y = np.zeros((x.shape[0], p.hidden))
    for e in range(p.num_experts):
        rows, slots = np.nonzero(ids == e)
        if rows.size == 0:
            continue
        h = x[rows] @ w13[e].T  # [n, 2I]
        gate, up = h[:, :I], h[:, I:]
        act = gate / (1.0 + np.exp(-gate)) * up
        y[rows] += wts[rows, slots][:, None] * (act @ w2[e].T)
    return y


def rel_l2(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / den) if den > 0 else float(np.linalg.norm(got))


def run_ranks(n, fn):
    """fn(rank) on n Python threads at once; returns the results in rank order, re-raising the first
    failure. The ranks' collectives only complete if the binding releases the GIL."""
    results, errors = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a rank thread did not finish in 120 s"
    for e in errors:
        if e is not None:
            raise e
    return results
