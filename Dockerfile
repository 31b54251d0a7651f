# kvdepotd as a sidecar container. Build: docker build -t kvdepotd .
# torch comes from PyPI by default (a large CUDA-capable wheel); for a CPU-only image pass your
# PyTorch CPU wheel index: --build-arg TORCH_INDEX_URL=<index>.
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /opt/kvdepot
COPY pyproject.toml setup.py README.md ./
COPY client ./client
COPY server ./server
COPY proto ./proto
# The daemon's core is compiled by mypyc and its block copy built from C (setup.py;
# KVDEPOT_COMPILE=1 fails the build rather than ship either uncompiled); the compiler leaves the
# image again in the same layer.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    else pip install "$TORCH_SPEC"; fi \
 && KVDEPOT_COMPILE=1 pip install . \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 kvdepot \
 && mkdir -p /run/kvdepot /var/lib/kvdepot && chown kvdepot /run/kvdepot /var/lib/kvdepot

USER kvdepot
EXPOSE 50061 50062 9464
# The same defaults as outside a container, except that it listens on all interfaces and on a
# Unix socket in /run/kvdepot (share that folder with engine containers), and the TCP lane (the
# engine path's fast socket) has a fixed port, 50062, so it can be published. A disk tier is off unless
# asked for: KVDEPOT_DISK_DIR=/var/lib/kvdepot with a volume there (see docker-compose.yml).
ENV KVDEPOT_LISTEN=0.0.0.0:50061,unix:/run/kvdepot/kvdepotd.sock \
    KVDEPOT_LANE_PORT=50062 \
    KVDEPOT_METRICS_LISTEN=0.0.0.0:9464
# Health over the Unix socket: plaintext whether or not TCP has TLS (--tls-cert).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["kvdepotd", "health", "unix:/run/kvdepot/kvdepotd.sock"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvdepotd"]
CMD ["serve"]
