"""Opening GPU memory an engine exported through the CUDA driver API (kvdepot.cuda_export): a
legacy IPC handle (cuIpcOpenMemHandle), or virtual-memory allocations as file descriptors
(cuMemImportFromShareableHandle, mapped in order at one reserved range). The memory is wrapped as
a torch uint8 tensor (__cuda_array_interface__) whose owner unmaps it when the last reference goes,
so copies still running keep it alive. Needs cuda-bindings where the daemon serves GPU engines.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdepot.cuda_export import IPC_HANDLE_BYTES, Unshareable, check, driver, ipc_handle, primary_context
from kvdepotd.core.errors import FailedPrecondition, InvalidRequest
from kvdepotd.storage.lazy_torch import torch as _torch

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class CudaDriverStorage:
    """A storage exported by the CUDA driver: an IPC handle, or chunks handed over as descriptors."""

    device: int
    size: int
    offset: int
    ipc_handle: bytes
    chunks: tuple[tuple[int, int, str], ...]  # (offset in the mapped range, size, handoff id)
    mapped_size: int


def _driver() -> Any:
    try:
        return driver()
    except Unshareable:
        raise FailedPrecondition("this daemon cannot open CUDA driver handles: install cuda-bindings beside it") from None


def _check(result: Any, what: str) -> Any:
    return check(result, f"cuda_driver handle does not open: {what}", InvalidRequest)


class _Mapped:
    """Device memory mapped into the daemon, as __cuda_array_interface__ for torch; `release`
    undoes the mapping once nothing refers to it."""

    def __init__(self, ptr: int, size: int, release: Callable[[], None]) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}
        weakref.finalize(self, release)


def open_storage(h: CudaDriverStorage, fds: Mapping[str, int]) -> torch.Tensor:
    """The storage's bytes as a uint8 tensor on its device (`fds`: the descriptors its chunks name,
    the caller's to close)."""
    torch = _torch()
    if not torch.cuda.is_available():
        raise FailedPrecondition("this daemon has no CUDA device: it cannot map cuda_driver handles")
    if h.device >= torch.cuda.device_count():
        raise InvalidRequest(f"cuda_driver device {h.device} does not exist here ({torch.cuda.device_count()} devices)")
    cu = _driver()
    primary_context(h.device, InvalidRequest)  # a thread of the daemon's pool: a driver call needs a current context
    mapped = _open_ipc(cu, h) if h.ipc_handle else _map_chunks(cu, h, fds)
    return torch.as_tensor(mapped, device=f"cuda:{h.device}")


def _open_ipc(cu: Any, h: CudaDriverStorage) -> _Mapped:
    if len(h.ipc_handle) != IPC_HANDLE_BYTES:
        raise InvalidRequest(f"cuda_driver ipc_handle has {len(h.ipc_handle)} bytes, not {IPC_HANDLE_BYTES}")
    flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    base = int(_check(cu.cuIpcOpenMemHandle(ipc_handle(h.ipc_handle), flags), "cuIpcOpenMemHandle"))

    def release() -> None:
        primary_context(h.device, InvalidRequest)  # finalizers run on whatever thread dropped the last reference
        cu.cuIpcCloseMemHandle(base)

    try:
        _, size = _check(cu.cuMemGetAddressRange(base), "cuMemGetAddressRange")
        if h.offset + h.size > int(size):  # every byte a copy may touch lies in the allocation
            raise InvalidRequest(f"cuda_driver storage [{h.offset}, {h.offset + h.size}) does not fit the {int(size)}-byte allocation")
    except BaseException:
        release()
        raise
    return _Mapped(base + h.offset, h.size, release)


def _map_chunks(cu: Any, h: CudaDriverStorage, fds: Mapping[str, int]) -> _Mapped:
    if not h.chunks or h.offset + h.size > h.mapped_size:
        raise InvalidRequest("cuda_driver: the chunks must cover [offset, offset + size) of the mapped range")
    at = 0
    for off, size, _ in h.chunks:
        if off != at or size == 0:
            raise InvalidRequest("cuda_driver: the chunks must follow each other from 0 without gaps")
        at += size
    if at != h.mapped_size:
        raise InvalidRequest(f"cuda_driver: the chunks cover {at} bytes, mapped_size says {h.mapped_size}")
    posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    base = int(_check(cu.cuMemAddressReserve(h.mapped_size, 0, 0, 0), "cuMemAddressReserve"))
    done: list[tuple[int, int]] = []

    def release() -> None:
        primary_context(h.device, InvalidRequest)
        for ptr, size in done:
            cu.cuMemUnmap(ptr, size)
        cu.cuMemAddressFree(base, h.mapped_size)

    try:
        for off, size, handoff_id in h.chunks:
            handle = _check(cu.cuMemImportFromShareableHandle(fds[handoff_id], posix_fd), "cuMemImportFromShareableHandle")
            try:
                _check(cu.cuMemMap(base + off, size, 0, handle, 0), "cuMemMap")
            finally:
                cu.cuMemRelease(handle)  # the mapping holds the allocation
            done.append((base + off, size))
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = h.device
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(base, h.mapped_size, [desc], 1), "cuMemSetAccess")
    except BaseException:
        release()
        raise
    return _Mapped(base + h.offset, h.size, release)

