"""One host copy of a table shared by every process on a machine: POSIX shared memory (a file in /dev/shm) mapped
by each process and registered with CUDA per process (registration is per process; the pages are shared).

Forked DataLoader workers need none of this: a unified tensor created before the fork is inherited and, indexed
with CPU indices in the worker, gathers on the CPU without any CUDA call.
"""

from __future__ import annotations

import math
import os
import secrets
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from ._create import unified
from ._memory import describe_bytes, element_size, shape_of
from ._tensor import UnifiedTensor

SHM_DIR = "/dev/shm"

# (device, inode) of a segment -> the unified tensor of this process's attachment. A second attachment in the same
# process reuses it: two virtual mappings of the same pages, each registered with CUDA, broke gathers from the second
# one on the GPU machine (cudaErrorInvalidValue at launch), and one registration per process is all that is needed.
_ATTACHED: weakref.WeakValueDictionary[tuple[int, int], UnifiedTensor] = weakref.WeakValueDictionary()


def _path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"shared memory name {name!r} must be a plain file name (no '/')")
    return os.path.join(SHM_DIR, name)


def shared_memory(name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32, *,
                  create: bool) -> UnifiedTensor:
    """The unified tensor over shared memory segment `name`: create=True makes it (it must not exist yet),
    create=False attaches to one another process created. Remove the name with :func:`unlink_shared_memory` once
    every process has attached; the memory lives until the last process drops its tensor."""
    shape = shape_of(tuple(shape))
    nbytes = math.prod(shape) * element_size(dtype)
    path = _path(name)
    if create:
        if os.path.exists(path):
            raise FileExistsError(f"shared memory {name!r} already exists ({path}): pick another name or unlink it")
        free = free_bytes(SHM_DIR)
        if free is not None and nbytes > free:
            # (the segment's pages are taken when first written: past the file system's room the writing process
            # gets SIGBUS and dies without a Python error)
            raise MemoryError(
                f"shared memory {name!r} needs {describe_bytes(nbytes)} (shape {shape} of {dtype}) but {SHM_DIR} has "
                f"{describe_bytes(free)} free: enlarge it (in a container, e.g. docker run --shm-size=...; Docker "
                "gives 64 MiB by default), free it, or share a smaller table"
            )
    else:
        if not os.path.exists(path):
            raise FileNotFoundError(f"shared memory {name!r} does not exist ({path}): create it first (create=True)")
        size = os.path.getsize(path)
        if size != nbytes:
            raise ValueError(f"shared memory {name!r} holds {size} bytes, but shape {shape} of {dtype} needs {nbytes}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype).as_subclass(UnifiedTensor)
    if not create:
        st = os.stat(path)
        attached = _ATTACHED.get((st.st_dev, st.st_ino))
        if attached is not None:
            with torch._C.DisableTorchFunctionSubclass():
                flat = attached.reshape(-1).view(torch.uint8)
                return flat[:nbytes].view(dtype).view(shape).as_subclass(UnifiedTensor)
    mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    out = unified(mapped.view(dtype).view(shape), copy=False)
    st = os.stat(path)
    _ATTACHED[(st.st_dev, st.st_ino)] = out
    return out


def free_bytes(directory: str) -> int | None:
    """The bytes an unprivileged process may still write in ``directory``'s file system, or None where unknown."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def unlink_shared_memory(name: str) -> None:
    """Removes the name (existing mappings stay valid); missing names are ignored."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def share(t: Tensor | None, *, group: torch.distributed.ProcessGroup | None = None) -> UnifiedTensor:
    """Every process of a ``torch.distributed`` job on this machine gets the same host copy of ``t``.

    Call it in every process after ``init_process_group`` (torchrun, mp.spawn); ``t`` is needed only on the
    process with ``LOCAL_RANK`` 0 (others may pass None). Single-node jobs without LOCAL_RANK use global rank 0.
    Collective: every process of ``group`` must call it. Returns a unified tensor over shared memory.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "share() needs torch.distributed to be initialised (dist.init_process_group after torchrun or "
            "mp.spawn); without it use pytorch_direct.shared_memory(name, shape, dtype, create=...)"
        )
    rank = dist.get_rank(group)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    creator = local_rank == 0
    if creator and t is None:
        raise ValueError("share(): the process with LOCAL_RANK 0 must pass the tensor to share")
    meta = [None]
    if rank == 0:
        if t is None:
            raise ValueError("share(): rank 0 must pass the tensor to share")
        meta = [(f"pytorch_direct-{os.getpid()}-{secrets.token_hex(6)}", tuple(t.shape), t.dtype)]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(meta, src=src, group=group)
    name, shape, dtype = meta[0]
    if creator:
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"share(): this node's tensor has shape {tuple(t.shape)}/{t.dtype}, rank 0's {shape}/{dtype}"
            )
        out = shared_memory(name, shape, dtype, create=True)
        with torch._C.DisableTorchFunctionSubclass():
            out.copy_(t.detach())
    dist.barrier(group=group)
    if not creator:
        out = shared_memory(name, shape, dtype, create=False)
    dist.barrier(group=group)
    if creator:
        unlink_shared_memory(name)  # every process is attached; the pages live as long as someone maps them
    return out
