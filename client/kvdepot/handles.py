"""Export an engine's KV tensors to the daemon as handles (never pickled, never copied over gRPC).

    share_cpu_tensors(tensors)   moves each tensor's storage onto a /dev/shm file (mode 0600): the
                                 bytes are copied there and the tensor is re-pointed with set_(), so
                                 the engine keeps using the same tensor objects; tensors that shared
                                 a storage (vLLM CPU's per-layer views) keep sharing one file
    share_cpu_tensors_memfd(...) the same onto sealed memfds, handed to the daemon over its handoff
                                 socket (a daemon reached at unix:PATH): no file, no shared user
    export_cuda_tensors(tensors) torch's CUDA IPC sharing fields per storage, else the CUDA driver's
                                 handles (kvdepot.cuda_export: memory of any allocator)
    engine_copy_request(tensors) the registration of a rank that copies its blocks itself
    allocating_on_shared_memory(memfd)   a context inside which the engine's KV cache allocation
                                 (one large CPU torch.zeros) is made on a memfd or /dev/shm file
                                 from the start; the share_* functions then find the tensors there
                                 and copy nothing (else they copy, as above)
    remove_shm_files(paths)      unlinks what share_cpu_tensors created (also done at interpreter exit;
                                 the mappings stay valid, the files only serve a daemon that restarts)
    remove_stale_files()         unlinks files of engine processes that died without exiting (done
                                 by share_cpu_tensors)

They return a pb.RegisterKvCachesRequest without engine id and rank, ready for register_kv_caches.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvdepot import cuda_export
from kvdepot.cuda_export import Unshareable
from kvdepot.v1 import kvdepot_pb2 as pb

SHM_DIR = "/dev/shm"
MIN_PREMADE_BYTES = 1 << 20  # the smallest torch.zeros taken for the KV cache inside allocating_on_shared_memory
log = logging.getLogger("kvdepot")
_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


def _group(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.UntypedStorage], list[int]]:
    storages: list[torch.UntypedStorage] = []
    index: dict[int, int] = {}
    which = []
    for t in tensors:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key not in index:
            index[key] = len(storages)
            storages.append(s)
        which.append(index[key])
    return storages, which


def _tensor_pb(name: str, t: torch.Tensor, storage: int) -> pb.KvTensor:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} cannot be shared")
    return pb.KvTensor(name=name, storage=storage, storage_offset=int(t.storage_offset()), shape=[int(d) for d in t.shape], stride=[int(s) for s in t.stride()], dtype=_DTYPES[t.dtype])


@dataclass(frozen=True)
class _Premade:
    """Shared memory the KV cache was allocated on (allocating_on_shared_memory): a memfd (fd) or
    a /dev/shm file (path), of nbytes."""

    handle: pb.CpuShmHandle
    fd: int
    path: str
    nbytes: int


_premade: dict[int, _Premade] = {}  # storage address -> where it lives
_premade_lock = threading.Lock()


@contextlib.contextmanager
def allocating_on_shared_memory(memfd: bool) -> Iterator[None]:
    """Inside it, the first CPU `torch.zeros` of at least MIN_PREMADE_BYTES of one-byte elements
    (vLLM allocates its KV cache as one such buffer, inside the connector's get_mem_pool_context)
    is made on shared memory: a sealed memfd (`memfd`) or a /dev/shm file. Both come zeroed from
    the kernel, so the cache never exists twice, nor is reserved twice against a container's
    memory limit, as it is when share_* copies it over after vLLM allocated it. Where the memory
    cannot be had, the allocation is torch's own (and share_* copies later, or says why not)."""
    real = torch.zeros
    taken = False

    def zeros(*size: Any, **kw: Any) -> torch.Tensor:
        nonlocal taken
        n = _kv_buffer_bytes(size, kw)
        if not taken and n >= MIN_PREMADE_BYTES:
            taken = True
            try:
                return _premake(n, kw["dtype"], memfd)
            except OSError as e:
                log.warning("kvdepot: the KV cache could not be allocated on shared memory (%s): it is copied there at registration", e)
        return real(*size, **kw)

    torch.zeros = zeros
    try:
        yield
    finally:
        torch.zeros = real


def _kv_buffer_bytes(size: tuple[Any, ...], kw: dict[str, Any]) -> int:
    """The bytes of a torch.zeros call that may be the KV cache: one size, a one-byte dtype, on the
    CPU, nothing else asked for; else 0."""
    if set(kw) - {"dtype", "device"} or kw.get("dtype") not in (torch.int8, torch.uint8):
        return 0
    if torch.device(kw.get("device") or "cpu").type != "cpu":
        return 0
    dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    if len(dims) != 1 or not isinstance(dims[0], int):
        return 0
    return int(dims[0])


def _premake(nbytes: int, dtype: torch.dtype, memfd: bool) -> torch.Tensor:
    if memfd:
        fd = os.memfd_create("kvdepot-kv-cache", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)  # named apart from a copy's
        try:
            _reserve(fd, nbytes, "of shared memory")
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        t = torch.frombuffer(mm, dtype=dtype)
        made = _Premade(pb.CpuShmHandle(offset=0, size=nbytes), fd, "", nbytes)
    else:
        remove_stale_files()
        path = _new_file(nbytes)
        atexit.register(remove_shm_files, [path])
        t = torch.from_file(path, shared=True, size=nbytes, dtype=dtype)
        made = _Premade(pb.CpuShmHandle(path=path, offset=0, size=nbytes), -1, path, nbytes)
    with _premade_lock:
        _premade[t.untyped_storage().data_ptr()] = made
    return t


def _adopter(memfd: bool, held: list[Any]) -> Callable[[torch.UntypedStorage], pb.CpuShmHandle | None]:
    """For _move_cpu_tensors: the handle of the shared memory a storage was allocated on, of the
    kind asked for, whose descriptor (memfd) or path joins `held`; taken, so it is registered once."""

    def adopt(s: torch.UntypedStorage) -> pb.CpuShmHandle | None:
        with _premade_lock:
            made = _premade.get(s.data_ptr())
            if made is None or made.nbytes != s.nbytes() or (made.fd >= 0) != memfd:
                return None
            del _premade[s.data_ptr()]
        held.append(made.fd if memfd else made.path)
        return made.handle

    return adopt


def _new_file(nbytes: int) -> str:
    path = os.path.join(SHM_DIR, f"kvdepot-{os.getpid()}-{uuid.uuid4().hex[:12]}.kv")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _reserve(fd, nbytes, f"in {SHM_DIR} (give the engine a larger {SHM_DIR}, e.g. docker --shm-size, or reach the daemon at a unix: address, which takes memfds)")
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def share_cpu_tensors(tensors: Sequence[torch.Tensor], num_blocks: int, names: Sequence[str] = ()) -> tuple[pb.RegisterKvCachesRequest, list[str]]:
    """Moves CPU tensors onto /dev/shm files; returns the registration and the files' paths."""
    remove_stale_files()
    paths: list[str] = []

    def onto_file(nbytes: int) -> tuple[torch.Tensor, pb.CpuShmHandle]:
        path = _new_file(nbytes)
        paths.append(path)
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), pb.CpuShmHandle(path=path, offset=0, size=nbytes)

    try:
        req = _move_cpu_tensors(tensors, num_blocks, names, onto_file, _adopter(False, paths))
    except BaseException:
        remove_shm_files(paths)
        raise
    atexit.register(remove_shm_files, list(paths))
    return req, paths


def share_cpu_tensors_memfd(tensors: Sequence[torch.Tensor], num_blocks: int, names: Sequence[str] = ()) -> tuple[pb.RegisterKvCachesRequest, list[int]]:
    """Moves CPU tensors onto memfds sealed against shrinking, for a daemon reached at unix:PATH:
    returns the registration and the descriptors, one per storage in its order, which
    WorkerLink.register_kv_caches hands over. Nothing lands in /dev/shm (nor counts against its
    size limit), and the memory goes when the last process holding it does."""
    fds: list[int] = []

    def onto_memfd(nbytes: int) -> tuple[torch.Tensor, pb.CpuShmHandle]:
        fd = os.memfd_create("kvdepot-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        fds.append(fd)
        _reserve(fd, nbytes, "of shared memory")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)  # the daemon maps it: it must never shrink
        mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes], pb.CpuShmHandle(offset=0, size=nbytes)

    try:
        return _move_cpu_tensors(tensors, num_blocks, names, onto_memfd, _adopter(True, fds)), fds
    except BaseException:
        close_fds(fds)
        raise


def _reserve(fd: int, nbytes: int, where: str) -> None:
    """Sizes the file and allocates every page now: a file too big for its filesystem (a container's
    small /dev/shm) would otherwise fail while the bytes are copied in, as a SIGBUS that kills the
    engine; this way it is an OSError before any tensor has moved."""
    try:
        os.ftruncate(fd, max(nbytes, 1))
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as e:
        size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / 2**20:.1f} MiB"
        raise OSError(e.errno, f"cannot reserve {size} {where}: {e.strerror}") from None


def _move_cpu_tensors(
    tensors: Sequence[torch.Tensor],
    num_blocks: int,
    names: Sequence[str],
    make: Callable[[int], tuple[torch.Tensor, pb.CpuShmHandle]],
    adopt: Callable[[torch.UntypedStorage], pb.CpuShmHandle | None],
) -> pb.RegisterKvCachesRequest:
    """Copies each storage's bytes into shared memory from `make` and re-points the tensors there;
    a storage already on shared memory of its own (`adopt`: allocating_on_shared_memory) stays."""
    storages, which = _group(tensors)
    moved: list[torch.UntypedStorage] = []
    handles = []
    for s in storages:
        if s.device.type != "cpu":
            raise ValueError("share_cpu_tensors takes CPU tensors; use export_cuda_tensors for CUDA")
        if (own := adopt(s)) is not None:
            moved.append(s)
            handles.append(pb.KvStorage(cpu_shm=own))
            continue
        shm, handle = make(s.nbytes())
        shm.copy_(torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),)))  # type: ignore[call-overload]
        moved.append(shm.untyped_storage())
        handles.append(pb.KvStorage(cpu_shm=handle))
    for t, i in zip(tensors, which):
        t.set_(moved[i], t.storage_offset(), t.size(), t.stride())
    names = list(names) or [f"layer{i}" for i in range(len(tensors))]
    return pb.RegisterKvCachesRequest(num_blocks=num_blocks, storages=handles, tensors=[_tensor_pb(n, t, i) for n, t, i in zip(names, tensors, which)])


def export_cuda_tensors(
    tensors: Sequence[torch.Tensor], num_blocks: int, names: Sequence[str] = (), may_hand_over: bool = False
) -> tuple[pb.RegisterKvCachesRequest, list[int]]:
    """Handles of the tensors' storages (the tensors must stay alive while registered) and the
    descriptors to hand over with them: torch's CUDA IPC sharing for memory of torch's allocator,
    else the CUDA driver's (kvdepot.cuda_export: any allocator; virtual memory as descriptors, when
    `may_hand_over`). Unshareable when neither can export a storage."""
    storages, which = _group(tensors)
    handles, fds = [], []
    try:
        for s in storages:
            if s.device.type != "cuda":
                raise ValueError("export_cuda_tensors takes CUDA tensors")
            try:
                device, handle, size, offset, ref_handle, ref_offset, event, event_sync = s._share_cuda_()
            except RuntimeError as e:  # not torch's allocation (TensorRT-LLM's pool): the driver's
                try:
                    h, got = cuda_export.export_storage(s, may_hand_over)
                except Unshareable as why:
                    raise Unshareable(f"torch cannot share it ({str(e).splitlines()[0]}), nor the CUDA driver: {why}") from None
                handles.append(pb.KvStorage(cuda_driver=h))
                fds += got
                continue
            handles.append(
                pb.KvStorage(
                    cuda_ipc=pb.CudaIpcHandle(
                        device=device, handle=handle, size=size, offset=offset, ref_counter_handle=ref_handle,
                        ref_counter_offset=ref_offset, event_handle=event or b"", event_sync_required=bool(event_sync),
                    )
                )
            )
    except BaseException:
        close_fds(fds)
        raise
    names = list(names) or [f"layer{i}" for i in range(len(tensors))]
    return pb.RegisterKvCachesRequest(num_blocks=num_blocks, storages=handles, tensors=[_tensor_pb(n, t, i) for n, t, i in zip(names, tensors, which)]), fds


def engine_copy_request(tensors: Sequence[torch.Tensor], num_blocks: int, names: Sequence[str] = ()) -> pb.RegisterKvCachesRequest:
    """The registration of a rank that copies its blocks itself: its tensors as views, no memory."""
    storages, which = _group(tensors)
    names = list(names) or [f"layer{i}" for i in range(len(tensors))]
    return pb.RegisterKvCachesRequest(num_blocks=num_blocks, tensors=[_tensor_pb(n, t, i) for n, t, i in zip(names, tensors, which)], engine_copies=True)


def remove_stale_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Removes this user's KV files left by engine processes that are gone (a worker killed with
    SIGKILL never runs its exit handler; each file is GiBs of shared memory). Returns them."""
    removed = []
    for name in os.listdir(shm_dir):
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "kvdepot" or not name.endswith(".kv") or not parts[1].isdigit():
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        except OSError:  # alive under another user (EPERM), or the file went away
            continue
    return removed


def close_fds(fds: Sequence[int]) -> None:
    """Closes what share_cpu_tensors_memfd returned (the tensors keep their memory)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def remove_shm_files(paths: Sequence[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
