"""What every engine connector shares: its settings (config) and its worker side (worker): the KV
memory shared with the daemon, the wait for a step's loads, forward-done, and the completion
stream. kvdepot.vllm and kvdepot.trtllm put each engine's own API on top."""
