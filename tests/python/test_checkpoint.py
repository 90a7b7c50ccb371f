"""megamoe.load_checkpoint_experts on small synthetic Hugging Face checkpoints the tests write (bf16 and
DeepSeek-V3 fp8-block layouts, one file and an index over two): this rank's experts bit for bit, the
geometry from config.json, a cpu layer on them against a float64 reference, and the refusals."""
import json
import struct

import numpy as np
import pytest

import megamoe
from megamoe import _C
from moe_problem import BF16

ml = pytest.importorskip("ml_dtypes")
E4M3 = np.dtype(ml.float8_e4m3fn)

H, I, E, K = 256, 128, 4, 2


def write_safetensors(path, tensors):
    """tensors: {name: (safetensors dtype, numpy array)} laid out back to back."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_config(d, num_layers=2, dense=1):
    (d / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E,
        "num_experts_per_tok": K, "num_hidden_layers": num_layers, "first_k_dense_replace": dense}))


def experts(seed, fp8=False):
    """Per expert (gate [I, H], up [I, H], down [H, I]) as the checkpoint stores them (+ fp8 scales)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(E):
        mats = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in ((I, H), (I, H), (H, I))]
        if not fp8:
            out.append([(m.astype(BF16), None) for m in mats])
        else:
            out.append([(m.astype(E4M3), rng.uniform(0.5, 2, (m.shape[0] // 128, m.shape[1] // 128)).astype(np.float32))
                        for m in mats])
    return out


def write_checkpoint(d, ex, layer=1, fp8=False, split=False):
    write_config(d)
    tensors = {}
    for e, projs in enumerate(ex):
        for proj, (w, s) in zip(("gate_proj", "up_proj", "down_proj"), projs):
            base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
            tensors[base + ".weight"] = ("F8_E4M3" if fp8 else "BF16", w.view(np.uint8 if fp8 else np.uint16))
            if fp8:
                tensors[base + ".weight_scale_inv"] = ("F32", s)
    if not split:
        write_safetensors(d / "model.safetensors", tensors)
        return
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        write_safetensors(d / file, {n: tensors[n] for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}))


def bits(a):
    return a.view(np.uint8 if a.itemsize == 1 else np.uint16 if a.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("split", [False, True], ids=["one-file", "index"])
def test_bf16_experts_of_rank_1_of_2_bit_for_bit(tmp_path, split):
    ex = experts(1)
    write_checkpoint(tmp_path, ex, split=split)
    ck = megamoe.load_checkpoint_experts(tmp_path, layer=1, ep_size=2, ep_rank=1, max_tokens_per_rank=16)
    g = ck.geometry
    assert (g.hidden, g.intermediate, g.num_experts, g.top_k, g.ep_size, g.ep_rank, g.max_tokens_per_rank) == \
        (H, I, E, K, 2, 1, 16)
    assert ck.weight_format == megamoe.WeightFormat.bf16 and ck.layer == 1
    assert len(ck.files) == (2 if split else 1)
    assert f"layer 1, unquantised (bf16 / fp32), experts [2, 4) of 4 from {len(ck.files)} file(s)" == ck.description
    w = ck.weights
    assert w.w13.dtype == BF16 and w.w13.shape == (2, 2 * I, H) and w.w2.shape == (2, H, I)
    assert w.w13_scale is None and w.w2_scale is None
    for local, e in enumerate((2, 3)):
        gate, up, down = (m for m, _ in ex[e])
        np.testing.assert_array_equal(bits(w.w13[local]), bits(np.concatenate([gate, up])))
        np.testing.assert_array_equal(bits(w.w2[local]), bits(down))


def test_fp8_block_experts_keep_their_scales(tmp_path):
    ex = experts(2, fp8=True)
    write_checkpoint(tmp_path, ex, fp8=True)
    ck = megamoe.load_checkpoint_experts(tmp_path, layer=1)
    assert ck.weight_format == megamoe.WeightFormat.fp8_block and "fp8-block" in ck.layout
    w = ck.weights
    assert w.w13.dtype == E4M3 and w.w13_scale.dtype == np.float32
    assert w.w13_scale.shape == (E, 2 * I // 128, H // 128) and w.w2_scale.shape == (E, H // 128, I // 128)
    for e in range(E):
        (gate, gs), (up, us), (down, ds) = ex[e]
        np.testing.assert_array_equal(bits(w.w13[e]), bits(np.concatenate([gate, up])))
        np.testing.assert_array_equal(w.w13_scale[e], np.concatenate([gs, us]))
        np.testing.assert_array_equal(bits(w.w2[e]), bits(down))
        np.testing.assert_array_equal(w.w2_scale[e], ds)
    assert ck.config().weight_format == megamoe.WeightFormat.fp8_block


def test_a_cpu_layer_on_the_loaded_experts_matches_float64(tmp_path):
    ex = experts(3)
    write_checkpoint(tmp_path, ex)
    ck = megamoe.load_checkpoint_experts(tmp_path, layer=1, max_tokens_per_rank=8)
    cfg = ck.config(backend="cpu", dispatch_format="bf16")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, H)).astype(BF16)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(6)]).astype(np.int32)
    wts = rng.uniform(0.1, 1, (6, K)).astype(np.float32)
    with megamoe.MoeLayer(ck.geometry, ck.weights, cfg) as layer:
        y = layer.warmup().forward(x, ids, wts)
    want = np.zeros((6, H))
    for t in range(6):
        for j in range(K):
            gate, up, down = (m.astype(np.float64) for m, _ in ex[ids[t, j]])
            xt = x[t].astype(np.float64)
            g, u = gate @ xt, up @ xt
            want[t] += wts[t, j] * (down @ (g / (1 + np.exp(-g)) * u))
    err = np.linalg.norm(y.astype(np.float64) - want) / np.linalg.norm(want)
    assert err < _C._error_bound(cfg, K)[0]


def test_refusals_name_the_file_and_the_tensor(tmp_path):
    with pytest.raises(megamoe.MegamoeIOError) as info:
        megamoe.load_checkpoint_experts(tmp_path / "nowhere", layer=1)
    assert isinstance(info.value, OSError) and "config.json" in str(info.value)
    ex = experts(5)
    write_checkpoint(tmp_path, ex)
    with pytest.raises(megamoe.InvalidArgumentError, match="first_k_dense_replace=1"):  # layer 0 is dense
        megamoe.load_checkpoint_experts(tmp_path, layer=0)
    (tmp_path / "model.safetensors").unlink()
    ex[1][2] = (ex[1][2][0][:, :64].copy(), None)  # expert 1's down_proj: [H, 64], not [H, I]
    write_checkpoint(tmp_path, ex)
    with pytest.raises(megamoe.InvalidArgumentError, match=r"model\.layers\.1\.mlp\.experts\.1\.down_proj\.weight") as info:
        megamoe.load_checkpoint_experts(tmp_path, layer=1)
    assert "model.safetensors: tensor" in str(info.value) and "shape=[256, 64]" in str(info.value), str(info.value)
