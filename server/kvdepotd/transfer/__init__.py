"""Copy engines: run the plans the core hands out (op parts, disk jobs) on their own threads and
report each result on the event loop. base: the contract; host: engine memory <-> the host tier;
disk: the host tier <-> disk files; mapping: engine KV memory as the daemon maps it; blockcopy: the
native copy."""
