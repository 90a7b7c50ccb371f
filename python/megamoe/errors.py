"""Exceptions of megamoe: one class per C++ StatusCode, with the C++ message unchanged.

Every class derives from MegamoeError (a RuntimeError); some also from the builtin a caller would
catch for that kind of failure: InvalidArgumentError is a ValueError, CommTimeoutError a
TimeoutError, MegamoeIOError an OSError.
"""
from __future__ import annotations


class MegamoeError(RuntimeError):
    """A non-ok megamoe Status. `code` is the C++ StatusCode's name."""

    code = "internal"


class InvalidArgumentError(MegamoeError, ValueError):
    """A field or argument breaks a rule; the message names the field, the value and the rule."""

    code = "invalid_argument"


class UnavailableError(MegamoeError):
    """A backend or device is not there (a capability gate, no GPU, an old NCCL)."""

    code = "unavailable"


class FailedPreconditionError(MegamoeError):
    """Right call, wrong time (a forward under CUDA-graph capture before warmup())."""

    code = "failed_precondition"


class CommTimeoutError(MegamoeError, TimeoutError):
    """A bounded cross-rank wait expired; the message names the stage and the peer."""

    code = "timeout"


class MegamoeIOError(MegamoeError, OSError):
    """Files: the knob cache, dumps, the NCCL id file."""

    code = "io_error"


class CudaError(MegamoeError):
    code = "cuda_error"


class NcclError(MegamoeError):
    code = "nccl_error"


class InternalError(MegamoeError):
    code = "internal"


# StatusCode value (megamoe/status.h order) -> class.
BY_CODE = {
    1: InvalidArgumentError,
    2: UnavailableError,
    3: FailedPreconditionError,
    4: CommTimeoutError,
    5: MegamoeIOError,
    6: CudaError,
    7: NcclError,
    8: InternalError,
}

__all__ = [c.__name__ for c in BY_CODE.values()] + ["MegamoeError"]
