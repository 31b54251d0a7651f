"""Export an engine's KV tensors to the daemon as handles (never pickled, never copied over gRPC).

    share_cpu_tensors(tensors)   moves each tensor's storage onto a /dev/shm file (mode 0600): the
                                 bytes are copied there and the tensor is re-pointed with set_(), so
                                 the engine keeps using the same tensor objects; tensors that shared
                                 a storage (vLLM CPU's per-layer views) keep sharing one file
    export_cuda_tensors(tensors) torch's CUDA IPC sharing fields, per storage
    remove_shm_files(paths)      unlinks what share_cpu_tensors created (also done at interpreter exit;
                                 the mappings stay valid, the files only serve a daemon that restarts)
    remove_stale_files()         unlinks files of engine processes that died without exiting (done
                                 by share_cpu_tensors)

Both return a pb.RegisterKvCachesRequest without engine id and rank, ready for register_kv_caches.
"""

from __future__ import annotations

import atexit
import os
import uuid
from collections.abc import Sequence

import torch

from kvdepot.v1 import kvdepot_pb2 as pb

SHM_DIR = "/dev/shm"
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


def share_cpu_tensors(tensors: Sequence[torch.Tensor], num_blocks: int, names: Sequence[str] = ()) -> tuple[pb.RegisterKvCachesRequest, list[str]]:
    """Moves CPU tensors onto /dev/shm files; returns the registration and the files' paths."""
    remove_stale_files()
    storages, which = _group(tensors)
    moved: list[torch.UntypedStorage] = []
    paths: list[str] = []
    handles = []
    for s in storages:
        if s.device.type != "cpu":
            raise ValueError("share_cpu_tensors takes CPU tensors; use export_cuda_tensors for CUDA")
        path = os.path.join(SHM_DIR, f"kvdepot-{os.getpid()}-{uuid.uuid4().hex[:12]}.kv")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(s.nbytes(), 1))
        finally:
            os.close(fd)
        paths.append(path)
        shm = torch.from_file(path, shared=True, size=s.nbytes(), dtype=torch.uint8)
        shm.copy_(torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),)))  # type: ignore[call-overload]
        moved.append(shm.untyped_storage())
        handles.append(pb.KvStorage(cpu_shm=pb.CpuShmHandle(path=path, offset=0, size=s.nbytes())))
    for t, i in zip(tensors, which):
        t.set_(moved[i], t.storage_offset(), t.size(), t.stride())
    atexit.register(remove_shm_files, list(paths))
    names = list(names) or [f"layer{i}" for i in range(len(tensors))]
    req = pb.RegisterKvCachesRequest(num_blocks=num_blocks, storages=handles, tensors=[_tensor_pb(n, t, i) for n, t, i in zip(names, tensors, which)])
    return req, paths


def export_cuda_tensors(tensors: Sequence[torch.Tensor], num_blocks: int, names: Sequence[str] = ()) -> pb.RegisterKvCachesRequest:
    """CUDA IPC handles of the tensors' storages (the tensors must stay alive while registered)."""
    storages, which = _group(tensors)
    handles = []
    for s in storages:
        if s.device.type != "cuda":
            raise ValueError("export_cuda_tensors takes CUDA tensors")
        device, handle, size, offset, ref_handle, ref_offset, event, event_sync = s._share_cuda_()
        handles.append(
            pb.KvStorage(
                cuda_ipc=pb.CudaIpcHandle(
                    device=device, handle=handle, size=size, offset=offset, ref_counter_handle=ref_handle,
                    ref_counter_offset=ref_offset, event_handle=event or b"", event_sync_required=bool(event_sync),
                )
            )
        )
    names = list(names) or [f"layer{i}" for i in range(len(tensors))]
    return pb.RegisterKvCachesRequest(num_blocks=num_blocks, storages=handles, tensors=[_tensor_pb(n, t, i) for n, t, i in zip(names, tensors, which)])


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


def remove_shm_files(paths: Sequence[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
