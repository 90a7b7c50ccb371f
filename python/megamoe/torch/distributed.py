"""Communicators from torch.distributed: the engines' process groups, one process per GPU.

comm_from_process_group(group, cpu_group=...) is the bootstrap vLLM's pynccl and pplx use: rank 0
of the group makes an NCCL unique id, broadcasts its 128 bytes over the engine's CPU (gloo) group,
and every rank joins a new NCCL communicator of the group's ranks. Collective; the result is cached
per (group, device), so every layer of a model shares one communicator (and one workspace).

adopt_nccl_comm(ptr) wraps an existing ncclComm_t (for instance torch's own) without owning it.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C

_comms: dict = {}


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def comm_from_process_group(group=None, cpu_group=None, device=None):
    """This rank's megamoe communicator over the ranks of `group` (default: the world group).

    cpu_group: a group of the same ranks that carries CPU tensors (gloo), for the id broadcast;
    default `group` itself (a CUDA tensor is used when that group's backend is NCCL). device: this
    rank's CUDA device (default: torch.cuda.current_device()). Collective over `group`.
    """
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    index = _device_index(device)
    key = (group, index)
    comm = _comms.get(key)
    if comm is not None:
        return comm
    bcast_group = group if cpu_group is None else cpu_group
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if dist.get_world_size(bcast_group) != size or dist.get_rank(bcast_group) != rank:
        raise ValueError(
            f"invalid argument: cpu_group has rank {dist.get_rank(bcast_group)} of {dist.get_world_size(bcast_group)}, "
            f"must hold the same ranks as group (rank {rank} of {size})")
    id_bytes = torch.zeros(128, dtype=torch.uint8)
    if rank == 0:
        id_bytes = torch.frombuffer(bytearray(bytes.fromhex(_C.nccl_unique_id_hex())), dtype=torch.uint8).clone()
    on_device = dist.get_backend(bcast_group) == "nccl"
    buf = id_bytes.to(torch.device("cuda", index)) if on_device else id_bytes
    src = dist.get_global_rank(bcast_group, 0) if hasattr(dist, "get_global_rank") else 0
    dist.broadcast(buf, src=src, group=bcast_group)
    id_hex = buf.cpu().numpy().tobytes().hex()
    comm = _C.create_nccl_rank(rank, size, index, id_hex)
    _comms[key] = comm
    return comm


def adopt_nccl_comm(comm_ptr: int, device: Optional[int] = None):
    """A megamoe communicator over an existing ncclComm_t (an integer address), not owned: megamoe
    never destroys it, and the caller keeps it alive while layers use it.

    Refused: a null pointer (torch's communicator exists only after one collective on the group), a
    process with two different libnccl loaded, and a runtime NCCL other than the one megamoe was
    compiled against (before NCCL 2.31 the device-communicator layout is fixed at compile time).
    """
    return _C.adopt_nccl_comm(int(comm_ptr), _device_index(device))


def torch_nccl_comm_ptr(group) -> int:
    """The ncclComm_t address of torch's NCCL backend for `group` (0 before its first collective)."""
    backend = group._get_backend(torch.device("cuda"))
    return int(backend._comm_ptr())
