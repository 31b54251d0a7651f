"""torch, imported at its first use rather than at start: importing it is most of a daemon's start
(about a second of 1.7 s on a 2-core machine), and a daemon needs it only once an engine maps its
KV memory (a mapping is tensors over it) or the machine has a GPU (the host tier is pinned).

    torch()          the module, imported once (thread-safe), set up as the daemon runs it
    cuda_present()   whether there is a CUDA device to pin the host tier for: asks torch only where
                     the NVIDIA driver's device node exists, so CPU machines never import it for this

The first caller pays for the import (engine registrations run on a worker thread, never on the
event loop). torch's intra-op threads are set to one: the copy engine runs each copy on its own
thread, and OpenMP teams inside each copy would only contend with those. What the import built is
frozen out of the cyclic collector, as start-up's objects are (kvdepotd.server.GC_THRESHOLDS).
"""

from __future__ import annotations

import gc
import os
import threading
from types import ModuleType

_lock = threading.Lock()
_module: ModuleType | None = None
NVIDIA_DEVICE = "/dev/nvidiactl"


def torch() -> ModuleType:
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                import torch as t

                t.set_num_threads(1)
                gc.freeze()
                _module = t
    return _module


def cuda_present() -> bool:
    return os.path.exists(NVIDIA_DEVICE) and bool(torch().cuda.is_available())
