"""The three kinds of error (STYLE.md 5). "Not now" is a value; a caller mistake raises one of
these; a broken invariant asserts. Only kvdepotd.errors maps them to gRPC status codes."""


def not_registered(engine_id: str) -> str:
    return f"engine {engine_id!r} is not registered (or its lease expired): register again"


class DepotError(Exception):
    """A caller mistake. The message says what was wrong; state is unchanged when it is raised."""


class InvalidRequest(DepotError):
    """The request itself is malformed or inconsistent (INVALID_ARGUMENT)."""


class NotFound(DepotError):
    """An engine, request or block id the daemon does not know (NOT_FOUND)."""


class FailedPrecondition(DepotError):
    """Well-formed, but not valid in the current state (FAILED_PRECONDITION)."""


class ResourceExhausted(DepotError):
    """A cap is reached: the engine or its namespace holds as much as it may (RESOURCE_EXHAUSTED)."""
