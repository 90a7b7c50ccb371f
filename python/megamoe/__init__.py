"""megamoe: an expert-parallel Mixture-of-Experts layer for LLM inference on NVIDIA Hopper.

    import megamoe
    g = megamoe.MoeGeometry(hidden=512, intermediate=256, num_experts=16, top_k=4,
                            max_tokens_per_rank=64)
    c = megamoe.MoeConfig(backend="cpu", weight_format="bf16", dispatch_format="bf16")
    with megamoe.MoeLayer(g, megamoe.MoeWeights(w13, w2), c) as layer:
        layer.warmup()
        y = layer.forward(x, topk_ids, topk_weights)

The typed API binds the C++ one (include/megamoe): MoeGeometry, MoeConfig (with Knobs) and their
validate(); select_backend() / capabilities(); communicators (host_group for the cpu backend,
nccl_group / nccl_rank for the GPU backends); MoeLayer. Failures raise the classes of
megamoe.errors with the C++ message. megamoe.torch adds torch tensors, the torch ops and the
process-group bootstrap; megamoe.integrations the vLLM, SGLang and TensorRT-LLM adapters.
"""
from __future__ import annotations

from . import _C
from . import errors
from .errors import (
    CommTimeoutError,
    CudaError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    MegamoeError,
    MegamoeIOError,
    NcclError,
    UnavailableError,
)

_C._set_error_classes(errors.BY_CODE)

from ._C import (  # noqa: E402
    Backend,
    CombineDtype,
    CommKind,
    Communicator,
    DispatchFormat,
    DType,
    Knobs,
    MoeConfig,
    MoeGeometry,
    OwnerReduce,
    WeightFormat,
)
from .layer import (  # noqa: E402
    MoeLayer,
    MoeWeights,
    capabilities,
    host_group,
    nccl_group,
    nccl_rank,
    nccl_unique_id,
    select_backend,
)

from .checkpoint import CheckpointExperts, load_checkpoint_experts  # noqa: E402

__version__ = _C.__version__

__all__ = [
    "Backend", "CombineDtype", "CommKind", "Communicator", "DispatchFormat", "DType", "Knobs", "MoeConfig",
    "MoeGeometry", "OwnerReduce", "WeightFormat", "MoeLayer", "MoeWeights", "capabilities", "host_group",
    "nccl_group", "nccl_rank", "nccl_unique_id", "select_backend", "errors", "MegamoeError",
    "InvalidArgumentError", "UnavailableError", "FailedPreconditionError", "CommTimeoutError", "MegamoeIOError",
    "CudaError", "NcclError", "InternalError", "CheckpointExperts", "load_checkpoint_experts",
]
