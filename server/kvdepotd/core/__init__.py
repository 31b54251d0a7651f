"""The pure core: slots, registry, pools, ops. No I/O, no RPC, no tensors, no clock (pass now_ms in)."""
