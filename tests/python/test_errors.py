"""Status -> exception mapping: one class per StatusCode, the builtin bases, the C++ message unchanged."""
import pytest

import megamoe
from megamoe import _C, errors

CASES = [
    (_C.StatusCode.invalid_argument, megamoe.InvalidArgumentError, ValueError),
    (_C.StatusCode.unavailable, megamoe.UnavailableError, None),
    (_C.StatusCode.failed_precondition, megamoe.FailedPreconditionError, None),
    (_C.StatusCode.timeout, megamoe.CommTimeoutError, TimeoutError),
    (_C.StatusCode.io_error, megamoe.MegamoeIOError, OSError),
    (_C.StatusCode.cuda_error, megamoe.CudaError, None),
    (_C.StatusCode.nccl_error, megamoe.NcclError, None),
    (_C.StatusCode.internal, megamoe.InternalError, None),
]


@pytest.mark.parametrize("code,cls,builtin", CASES, ids=[c[1].__name__ for c in CASES])
def test_every_code_raises_its_class_with_the_message_unchanged(code, cls, builtin):
    message = f"what was wrong: field=value, rule ({_C.name_of(code)})"
    with pytest.raises(cls) as info:
        _C._raise_status(int(code), message)
    assert str(info.value) == message
    assert isinstance(info.value, megamoe.MegamoeError)
    assert isinstance(info.value, RuntimeError)
    assert info.value.code == code.name
    if builtin is not None:
        assert isinstance(info.value, builtin)


def test_every_status_code_has_a_class():
    codes = {int(c) for c in _C.StatusCode if int(c) != 0}
    assert codes == set(errors.BY_CODE)


def test_ok_raises_nothing():
    _C._raise_status(0, "")


def test_a_real_refusal_carries_the_cpp_message():
    g = megamoe.MoeGeometry(hidden=2880, intermediate=256, num_experts=16, top_k=4, max_tokens_per_rank=8)
    with pytest.raises(ValueError) as info:
        g.validate()
    assert str(info.value) == (
        "invalid geometry: hidden=2880, must be a multiple of 128 (pad to 2944 with MoeGeometry::padded(), "
        "or --pad in the tool)")
