# syntax=docker/dockerfile:1
#
# streamer-service: the per-node checkpoint streaming daemon.
#
#   docker build -t streamer-service .
#
# Two stages: the builder installs both local packages (client/ = streamer-client, . =
# streamer-service) into a venv; the runtime stage copies only that venv onto a clean slim base
# and runs `streamer-service serve` as a fixed non-root UID/GID (10001), the UID the inference
# containers must share (docs/deploy.md, "Socket and segment permissions").

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/streamer-service
ENV PATH=/opt/streamer-service/bin:$PATH

# torch first, from the CPU wheel index. The daemon never touches a GPU: it reads ranges into
# shared memory and the ranks copy to their own GPUs. An unpinned `torch` from PyPI is the
# multi-GB CUDA build (plus the nvidia-* wheels); `+cpu` exists only on the CPU index, so the
# extra index is the one that serves it and PyPI serves torch's own dependencies. Keep the
# version in step with scripts/bootstrap. (aarch64: the CPU index names its wheels without
# `+cpu`; build with --build-arg TORCH_SPEC=torch==2.13.0.)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0+cpu
# hadolint ignore=DL3013
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

WORKDIR /src
# The thin client first: streamer-service pins streamer-client==0.1.0, satisfied by ./client.
COPY client/ client/
COPY pyproject.toml README.md ./
COPY streamer_service/ streamer_service/
# The import check fails the build, not the first pod, when a dependency of the daemon path is
# missing from pyproject.toml.
RUN pip install ./client . \
    && python -c "import streamer_service.server, streamer_service.api, streamer_service.daemon" \
    && streamer-service --help > /dev/null

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG STREAMER_UID=10001
ARG STREAMER_GID=10001

# A system user with no home and no shell; the socket and cache dirs owned by it (a named Docker
# volume mounted there starts with this ownership; Kubernetes mounts emptyDirs over them).
RUN groupadd --system --gid "${STREAMER_GID}" streamer \
    && useradd --system --uid "${STREAMER_UID}" --gid "${STREAMER_GID}" \
        --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin streamer \
    && install -d -o "${STREAMER_UID}" -g "${STREAMER_GID}" -m 0750 \
        /run/streamer /var/cache/streamer-service

COPY --from=builder /opt/streamer-service /opt/streamer-service

# STREAMER_SHM_DIR: /dev/shm is a tmpfs in every container, so the image works as is; a daemon
# whose budget does not fit says so at its first segment ("make the shm filesystem larger than
# STREAMER_SHM_BUDGET"): `docker run --shm-size`. Share it with the engine container through
# `--ipc=shareable` / `--ipc=container:NAME`. The Kubernetes manifests (deploy/) point it at a
# dedicated memory volume instead (containers of a pod do not share /dev/shm).
# HOME=/tmp: the user has no home; libraries that write caches get a writable place (Kubernetes
# mounts an emptyDir on /tmp under readOnlyRootFilesystem).
ENV PATH=/opt/streamer-service/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    STREAMER_SOCKET=/run/streamer/daemon.sock \
    STREAMER_SHM_DIR=/dev/shm \
    STREAMER_CACHE_DIR=/var/cache/streamer-service

# Numeric, so Kubernetes' runAsNonRoot can verify it without a runAsUser.
USER 10001:10001
WORKDIR /tmp

# The daemon speaks HTTP only on its unix socket: the check is the CLI, which asks /readyz.
# Python + torch import alone takes a few seconds on a busy node; hence the timeout.
HEALTHCHECK --interval=30s --timeout=15s --start-period=60s --retries=3 \
    CMD ["streamer-service", "health", "--ready"]

# Extra flags go after the image name: docker run ... streamer-service serve --allow s3://bucket/models/
ENTRYPOINT ["streamer-service"]
CMD ["serve"]
