# jetbatch sidecar image (worker or classifier), one image for every role.
#   docker build -t jetbatch:cpu .                              # CPU (python:3.11-slim)
#   docker build -t jetbatch:cuda --build-arg FLAVOR=cuda .     # CUDA 12.8 (Ubuntu 24.04, Python 3.12)
# compose.yaml builds both: the CUDA flavor for the GPU worker, the CPU one for the rest.
# Every base stage must ship a Python that pyproject's requires-python accepts
# (tests/test_examples.py reads this file and checks each stage).
ARG FLAVOR=cpu

FROM python:3.11-slim AS cpu-base
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS cuda-base
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM ${FLAVOR}-base AS final
# In a container the endpoints listen on every interface (probes and scrapes come from outside);
# elsewhere they default to loopback.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 JETBATCH_HOME=/var/lib/jetbatch JETBATCH_HTTP__HOST=0.0.0.0
RUN python3 -m venv /opt/jetbatch
ENV PATH=/opt/jetbatch/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY sidecar ./sidecar
COPY examples ./examples
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} torch \
    && pip install --no-cache-dir '.[sidecar]'
# The example producers (`python -m examples.webapp`) run from the source tree.
ENV PYTHONPATH=/src
# Non-root: the sidecar needs no privileges; its only state is the example models it may build.
# /models is where compose and the k8s example mount the models: it exists here, owned by the
# sidecar's user, because a fresh named volume takes the owner of the image's directory (without
# it the volume is root's and `examples build --dir /models` cannot write).
RUN groupadd --system --gid 10001 jetbatch \
    && useradd --system --uid 10001 --gid 10001 --home /var/lib/jetbatch --create-home jetbatch \
    && install -d -o jetbatch -g jetbatch -m 0755 /models
USER jetbatch
WORKDIR /var/lib/jetbatch
# /healthz, /readyz and /metrics: 9464 for a worker, 9465 for a classifier ([http] in the config).
EXPOSE 9464 9465
# Healthy when this container's sidecar answers /readyz on either port (no torch import).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["jetbatch", "probe"]
ENTRYPOINT ["jetbatch"]
CMD ["worker", "--config", "/etc/jetbatch/models.toml"]
