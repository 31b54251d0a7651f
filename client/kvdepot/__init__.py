"""kvdepot: the engine-side client of the kvdepotd KV-cache block manager."""

from kvdepot.aio import AsyncDepotClient
from kvdepot.client import DEFAULT_ADDRESS, DepotClient
from kvdepot.worker import WorkerLink
from kvdepot.auth import read_token
from kvdepot.errors import DepotError, FailedPrecondition, InvalidRequest, NotFound, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from kvdepot.hashing import BlockHash, block_hashes, salt_hash
from kvdepot.layout import KvLayout
from kvdepot.messages import LayersCopied, LoadCopied, LookupResult, OpCompleted, OpInfo, RequestReleased, StepBatch, StepResult
from kvdepot.tls import Tls

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncDepotClient",
    "BlockHash",
    "DepotClient",
    "DepotError",
    "FailedPrecondition",
    "InvalidRequest",
    "KvLayout",
    "LayersCopied",
    "LoadCopied",
    "LookupResult",
    "NotFound",
    "OpCompleted",
    "OpInfo",
    "PermissionDenied",
    "RequestReleased",
    "ResourceExhausted",
    "StepBatch",
    "StepResult",
    "Tls",
    "Unauthenticated",
    "Unavailable",
    "WorkerLink",
    "block_hashes",
    "read_token",
    "salt_hash",
]
