"""The pure core: slots, registry, pools, ops. No I/O, no RPC, no tensors, no clock (pass now_ms in)."""


def compiled() -> bool:
    """Whether the core's modules run as C extensions built by mypyc (setup.py) or as plain Python."""
    from kvdepotd.core import depot

    return not depot.__file__.endswith(".py")
