"""MoeGeometry / MoeConfig from Python: fields, validation messages, and the backend selection table."""
import pytest

import megamoe
from megamoe import Backend, _C


def geometry(**kw):
    base = dict(hidden=7168, intermediate=2048, num_experts=256, top_k=8, ep_size=8, ep_rank=0,
                max_tokens_per_rank=256)
    base.update(kw)
    return megamoe.MoeGeometry(**base)


def test_fields_round_trip_and_print_like_cpp():
    g = geometry()
    assert (g.hidden, g.intermediate, g.num_experts, g.top_k, g.ep_size, g.max_tokens_per_rank) == (
        7168, 2048, 256, 8, 8, 256)
    assert g.experts_per_rank == 32 and g.owner_of(70) == 2 and g.for_rank(3).first_local_expert == 96
    assert repr(g) == ("MoeGeometry(hidden=7168, intermediate=2048, num_experts=256, top_k=8, ep_size=8, "
                       "ep_rank=0, max_tokens_per_rank=256)")
    g.validate()


def test_config_takes_enum_values_or_canonical_names():
    c = megamoe.MoeConfig(backend="routed", weight_format="fp8-block", combine_dtype=megamoe.CombineDtype.mxfp8)
    assert c.backend == Backend.routed and c.weight_format == megamoe.WeightFormat.fp8_block
    assert c.combine_dtype == megamoe.CombineDtype.mxfp8
    c.owner_reduce = "on"
    assert c.owner_reduce == megamoe.OwnerReduce.on and c.uses_owner_reduce()
    c.knobs = megamoe.Knobs(block_m=64)
    assert c.knobs.block_m == 64
    k = megamoe.Knobs(block_n=128, num_sms=66, combine_groups=2, gemm_cluster=2, gemm_tile_order=1)
    assert (k.block_n, k.num_sms, k.combine_groups, k.gemm_cluster, k.gemm_tile_order) == (128, 66, 2, 2, 1)
    assert "gemm_tile_order=1" in repr(k)
    with pytest.raises(TypeError, match="unexpected keyword argument 'weightformat'"):
        megamoe.MoeConfig(weightformat="bf16")


@pytest.mark.parametrize("field,value,message", [
    ("hidden", 2880, "invalid geometry: hidden=2880, must be a multiple of 128"),
    ("intermediate", 100, "invalid geometry: intermediate=100, must be a multiple of 128"),
    ("num_experts", 250, "num_experts=250"),
    ("top_k", 0, "invalid geometry: top_k=0"),
    ("top_k", 300, "invalid geometry: top_k=300"),
    ("ep_rank", 8, "invalid geometry: ep_rank=8"),
])
def test_geometry_refusals_name_field_value_and_rule(field, value, message):
    with pytest.raises(megamoe.InvalidArgumentError) as info:
        geometry(**{field: value}).validate()
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_config_refusals_name_field_value_and_rule():
    with pytest.raises(megamoe.InvalidArgumentError, match="weight_format='fp9', must be one of: bf16, fp8-block"):
        megamoe.MoeConfig(weight_format="fp9")
    c = megamoe.MoeConfig(combine_dtype="mxfp8", in_kernel_fc2_reduce=True)
    with pytest.raises(megamoe.InvalidArgumentError, match="in_kernel_fc2_reduce"):
        c.validate()
    with pytest.raises(megamoe.InvalidArgumentError, match="block_m=48"):
        megamoe.MoeConfig(knobs=megamoe.Knobs(block_m=48)).validate(geometry())


PASS = None
MEGA_DOWN = (int(_C.StatusCode.unavailable), "mega gate says no")
ROUTED_DOWN = (int(_C.StatusCode.unavailable), "routed gate says no")
TABLE = [  # tokens, threshold, mega gate, routed gate, expected (tests/cpu/test_selection.cpp's table)
    (256, 1024, PASS, PASS, Backend.mega),         # decode
    (1024, 1024, PASS, PASS, Backend.mega),        # at the threshold
    (1025, 1024, PASS, PASS, Backend.routed),      # just above
    (8192, 1024, PASS, PASS, Backend.routed),      # prefill
    (4096, 4096, PASS, PASS, Backend.mega),        # raised threshold
    (256, 1024, MEGA_DOWN, PASS, Backend.routed),  # mega's gate fails
    (256, 1024, MEGA_DOWN, ROUTED_DOWN, Backend.cpu),
    (8192, 1024, PASS, ROUTED_DOWN, Backend.mega),  # only the threshold kept mega out
    (1, 0, PASS, ROUTED_DOWN, Backend.cpu),          # threshold 0: never mega
    (0, 1024, PASS, PASS, Backend.routed),         # 0 is not in (0, threshold]
    (1, 0, PASS, PASS, Backend.routed),            # threshold 0: never mega
]


@pytest.mark.parametrize("tokens,threshold,mega,routed,expected", TABLE)
def test_auto_selection_table(tokens, threshold, mega, routed, expected):
    c = megamoe.MoeConfig(mega_max_tokens_per_rank=threshold)
    backend, reason = _C.select_backend_with_gates(geometry(max_tokens_per_rank=tokens), c, mega, routed)
    assert backend == expected, reason
    assert reason


def test_fallback_reasons_name_the_gates():
    _, reason = _C.select_backend_with_gates(geometry(), megamoe.MoeConfig(), MEGA_DOWN, ROUTED_DOWN)
    assert "mega gate says no" in reason and "routed gate says no" in reason and reason.endswith("auto: cpu")
    _, reason = _C.select_backend_with_gates(geometry(max_tokens_per_rank=513), megamoe.MoeConfig(), PASS, PASS)
    assert "max_tokens_per_rank=513 > mega_max_tokens_per_rank=512" in reason


def test_explicit_backend_is_kept():
    backend, reason = _C.select_backend_with_gates(geometry(), megamoe.MoeConfig(backend="routed"), PASS, ROUTED_DOWN)
    assert backend == Backend.routed and reason == "backend=routed requested"


def test_real_gates_and_capabilities_answer_without_network():
    g = geometry(hidden=512, intermediate=256, num_experts=16, top_k=4, ep_size=1, max_tokens_per_rank=64)
    caps = megamoe.capabilities(g, megamoe.MoeConfig())
    assert set(caps) == {"mega", "routed", "cpu"}
    assert caps["cpu"] is None
    backend, reason = megamoe.select_backend(g)
    if _C.cuda_device_count() == 0:
        assert caps["mega"] and caps["routed"]  # no GPU: a reason each
        assert backend == Backend.cpu and "auto: cpu" in reason
