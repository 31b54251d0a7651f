"""GPU memory from any allocator, exported through the CUDA driver API (cuda-bindings).

torch's storage sharing (UntypedStorage._share_cuda_()) looks the allocation up in torch's own
caching allocator, so it throws for memory another allocator owns: TensorRT-LLM's KV pool is
cudaMalloc'd by its own buffer manager (and virtual memory, cuMemCreate + cuMemMap, under its
sleep mode). The driver knows every allocation:

    export_storage(storage) -> (pb.CudaDriverHandle, [descriptors])
        a legacy IPC handle of the allocation holding the storage, with the storage's offset in
        it (cudaMalloc, torch's caching allocator without expandable segments); or, for virtual
        memory, one POSIX file descriptor per physical allocation mapped over the storage
        (cuMemRetainAllocationHandle + cuMemExportToShareableHandle: the allocation must have been
        made exportable as a descriptor), which go over the handoff socket. Raises Unshareable
        saying why (a stream-ordered pool made without export, virtual memory without descriptor
        export, no cuda-bindings): the worker then copies its blocks itself (kvdepot.engine_copy).

kvdepotd.transfer.cuda_import opens them on the daemon's side. Imported only where a CUDA pool is
registered; `pip install cuda-bindings` (the release that matches the CUDA driver).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import TYPE_CHECKING, Any

from kvdepot.v1 import kvdepot_pb2 as pb

if TYPE_CHECKING:  # the storage exported is torch's; the daemon imports this module without torch
    import torch


IPC_HANDLE_BYTES = 64
MAX_CHUNKS = 250  # descriptors one handoff carries


class Unshareable(Exception):
    """Memory the daemon cannot map; the message says why."""


def driver() -> Any:
    """The CUDA driver bindings: cuda-bindings (cuda.bindings.driver), or cuda-python's older name."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu  # cuda-python before 12.6
        except ImportError:
            raise Unshareable("the CUDA driver API is not installed (pip install cuda-bindings)") from None
    return cu


def check(result: Any, what: str, error: type[Exception] = Unshareable) -> Any:
    """The value of a cuda-bindings call's (error, value...) tuple; `error` on an error."""
    cu = driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise error(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else tuple(rest)


_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def primary_context(device: int, error: type[Exception] = Unshareable) -> None:
    """Makes the device's primary context (the one torch's runtime uses) current on this thread:
    torch makes it current only when it needs it, and driver calls need one (a thread of a pool
    may have none)."""
    cu = driver()
    with _contexts_lock:
        ctx = _contexts.get(device)
        if ctx is None:
            check(cu.cuInit(0), "cuInit", error)
            dev = check(cu.cuDeviceGet(device), "cuDeviceGet", error)
            ctx = _contexts[device] = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain", error)
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", error)


def ipc_bytes(handle: Any) -> bytes:
    """A CUipcMemHandle's 64 bytes (cuda-bindings 13.4 and later expose no `reserved` field)."""
    return ctypes.string_at(int(handle.getPtr()), IPC_HANDLE_BYTES)


def ipc_handle(data: bytes) -> Any:
    cu = driver()
    handle = cu.CUipcMemHandle()
    ctypes.memmove(int(handle.getPtr()), data, IPC_HANDLE_BYTES)
    return handle


def _attr(cu: Any, name: str, ptr: int) -> Any:
    return check(cu.cuPointerGetAttribute(getattr(cu.CUpointer_attribute, name), ptr), f"cuPointerGetAttribute({name})")


def export_storage(storage: torch.UntypedStorage, may_hand_over: bool) -> tuple[pb.CudaDriverHandle, list[int]]:
    """`may_hand_over`: descriptors can reach the daemon (it listens at unix:PATH)."""
    cu = driver()
    device = storage.device.index or 0
    primary_context(device)
    return _export(cu, device, storage.data_ptr(), storage.nbytes(), may_hand_over)


def _export(cu: Any, device: int, ptr: int, size: int, may_hand_over: bool) -> tuple[pb.CudaDriverHandle, list[int]]:
    if int(_attr(cu, "CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE", ptr) or 0):
        raise Unshareable("the memory is a stream-ordered pool's (cudaMallocAsync): kvdepot exports no pools")
    if int(_attr(cu, "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE", ptr)):
        base = int(_attr(cu, "CU_POINTER_ATTRIBUTE_RANGE_START_ADDR", ptr))
        handle = check(cu.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        return pb.CudaDriverHandle(device=device, size=size, offset=ptr - base, ipc_handle=ipc_bytes(handle)), []
    if not int(_attr(cu, "CU_POINTER_ATTRIBUTE_MAPPING_SIZE", ptr) or 0):
        raise Unshareable("the memory is neither a legacy IPC allocation nor virtual memory (a stream-ordered pool made without export?)")
    posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if not int(_attr(cu, "CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES", ptr)) & int(posix_fd):
        raise Unshareable("its virtual memory was not made exportable as a file descriptor (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)")
    if not may_hand_over:
        raise Unshareable("virtual memory goes over the handoff socket: reach the daemon at a unix: address")
    first = int(_attr(cu, "CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR", ptr))
    chunks: list[pb.CudaDriverHandle.Chunk] = []
    fds: list[int] = []
    addr = first
    try:
        while addr < ptr + size:  # one physical allocation per mapping, in address order
            mbase, msize = int(_attr(cu, "CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR", addr)), int(_attr(cu, "CU_POINTER_ATTRIBUTE_MAPPING_SIZE", addr))
            handle = check(cu.cuMemRetainAllocationHandle(addr), "cuMemRetainAllocationHandle")
            try:
                fd = int(check(cu.cuMemExportToShareableHandle(handle, posix_fd, 0), "cuMemExportToShareableHandle"))
            finally:
                check(cu.cuMemRelease(handle), "cuMemRelease")
            fds.append(fd)
            chunks.append(pb.CudaDriverHandle.Chunk(offset=mbase - first, size=msize))
            addr = mbase + msize
            if len(fds) > MAX_CHUNKS:
                raise Unshareable(f"its virtual memory is more than {MAX_CHUNKS} physical allocations (one handoff at most)")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return pb.CudaDriverHandle(device=device, size=size, offset=ptr - first, chunks=chunks, mapped_size=addr - first), fds
