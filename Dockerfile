# polyspec, CPU image by default; a CUDA image by build argument. Installs the package the
# README's way (`python -m pip install "torch==2.13.0" -e ".[dev]"`).
#
#   docker build -t polyspec .
#   docker build -t polyspec:cuda \
#     --build-arg BASE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime \
#     --build-arg TORCH= --build-arg TORCH_INDEX= .
#
# The CUDA build keeps the base image's CUDA torch (TORCH empty); `quantize: int4` tiers run on
# torch's own weight-only kernels, so nothing else is added. The same image runs every service of docker-compose.yml: the Ray
# head, one Ray worker per tier and the orchestrator (`polyspec serve`).
ARG BASE=python:3.11-slim
FROM ${BASE}

# torch pin and index for the CPU image: the CPU wheel index keeps pip from fetching CUDA wheels
ARG TORCH="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# extra pip packages, if any
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/var/cache/huggingface

WORKDIR /opt/polyspec
COPY . .
# hadolint ignore=DL3013
RUN PIP_EXTRA_INDEX_URL="${TORCH_INDEX}" python -m pip install ${TORCH} -e ".[dev]" ${EXTRAS} \
    && polyspec --help > /dev/null

# gRPC API, Prometheus metrics; Ray: GCS, client server, dashboard
EXPOSE 50051 9464 6379 10001 8265
CMD ["polyspec", "serve", "-c", "configs/demo.yaml", "--host", "0.0.0.0", "--port", "50051", "--state-dir", "/var/lib/polyspec"]
