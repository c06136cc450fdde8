"""Sharded (DTensor) parameters, as FSDP2's `fully_shard` makes them: the three moves the optimizer (muon.py) and
the QAT masters (qat.py) need, in one place. Every function takes plain tensors too and returns them as they are."""

import torch


def dtensor_class():
    """torch's DTensor class, or None where torch.distributed is not built in."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(t):
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def full_tensor(t):
    """t as one whole tensor: a DTensor's shards all-gathered (collective over its mesh). Shards kept on the CPU
    (`CPUOffloadPolicy`) are gathered on the mesh's device."""
    if not is_dtensor(t):
        return t
    local, mesh = t.to_local(), t.device_mesh
    if local.device.type != mesh.device_type:
        t = type(t).from_local(local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()


def shard_like(full, p):
    """`full` laid out as p: a DTensor with p's mesh and placements, each rank keeping its own part of `full` (which
    every rank holds whole: no communication); `full` itself when p is no DTensor."""
    if not is_dtensor(p):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
