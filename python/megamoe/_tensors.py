"""How arrays cross into megamoe._C: a tuple (data_ptr, dtype, shape, strides, device_kind, index).

numpy arrays (bfloat16 and float8_e4m3fn through ml_dtypes) live on the host (the cpu backend);
torch tensors go through megamoe.torch, which adds device tensors. Strides are in elements.
"""
from __future__ import annotations

import numpy as np

from . import _C

try:
    import ml_dtypes as _ml
except ImportError:  # bf16 / e4m3 numpy arrays then cannot be made, the rest works
    _ml = None

_DEVICE_CPU = int(_C.DeviceKind.cpu)

_NUMPY_DTYPES = {
    np.dtype(np.float32): _C.DType.float32,
    np.dtype(np.float64): _C.DType.float64,
    np.dtype(np.float16): _C.DType.float16,
    np.dtype(np.int32): _C.DType.int32,
    np.dtype(np.int64): _C.DType.int64,
    np.dtype(np.uint8): _C.DType.uint8,
}
if _ml is not None:
    _NUMPY_DTYPES[np.dtype(_ml.bfloat16)] = _C.DType.bfloat16
    _NUMPY_DTYPES[np.dtype(_ml.float8_e4m3fn)] = _C.DType.float8_e4m3
    if hasattr(_ml, "float8_e8m0fnu"):
        _NUMPY_DTYPES[np.dtype(_ml.float8_e8m0fnu)] = _C.DType.float8_e8m0
_NUMPY_CODES = {np_dtype: int(code) for np_dtype, code in _NUMPY_DTYPES.items()}

BFLOAT16 = np.dtype(_ml.bfloat16) if _ml is not None else None
FLOAT8_E4M3 = np.dtype(_ml.float8_e4m3fn) if _ml is not None else None


def numpy_view(a: np.ndarray, name: str) -> tuple:
    code = _NUMPY_CODES.get(a.dtype)
    if code is None:
        names = ", ".join(sorted(str(d) for d in _NUMPY_CODES))
        _C._raise_status(1, f"invalid argument: {name}.dtype={a.dtype}, must be one of: {names}")
    itemsize = a.itemsize
    strides = tuple(s // itemsize if s % itemsize == 0 else -1 for s in a.strides)
    return (a.__array_interface__["data"][0], code, a.shape, strides, _DEVICE_CPU, 0)


def view(t, name: str):
    """The _C tuple of `t` (numpy array, torch tensor, or None)."""
    if t is None:
        return None
    if isinstance(t, np.ndarray):
        return numpy_view(t, name)
    if type(t).__module__.startswith("torch"):
        from .torch import _tensor_view  # noqa: PLC0415 (torch only when a tensor is given)

        return _tensor_view(t)
    raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(t).__name__}")
