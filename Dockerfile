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

# The base by digest, so that a rebuild gets the same bytes; refresh it deliberately with
# `docker buildx imagetools inspect python:3.11-slim-bookworm` (the index digest) and rebuild.
# bookworm: its glibc (2.36) is the platform requirements.lock was resolved for (scripts/lock).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/streamer-service
ENV PATH=/opt/streamer-service/bin:$PATH

# A C compiler for the native copier of local files (client/streamer_client/_copier.c, an optional
# extension: without it the daemon would read local files through Run:ai). Only this stage has
# one; the runtime stage gets the built module with the venv. Unpinned: the base is pinned by
# digest, libc6-dev must match its libc, and the import check below proves the module built.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Every dependency from requirements.lock, each wheel checked against its sha256 (pip
# --require-hashes); nothing is resolved at build time. torch is the CPU build: the daemon never
# touches a GPU, and an unpinned `torch` from PyPI is the multi-GB CUDA build (plus the nvidia-*
# wheels). `+cpu` exists only on PyTorch's CPU index, hence the extra index; the lock fixes which
# file. The lock is for x86_64 (scripts/lock; tests/test_image.py checks it has not drifted).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY requirements.lock ./
RUN pip install --require-hashes --no-deps --extra-index-url "${TORCH_INDEX_URL}" -r requirements.lock

# The two local packages on top, without dependencies (all in the lock already): the thin client
# first, since streamer-service pins streamer-client==0.1.0. `pip check` fails the build when the
# lock misses a requirement; the import check fails it, not the first pod, when a module of the
# daemon path needs something pyproject.toml does not declare. (Building these two wheels fetches
# setuptools into pip's isolated build env; it is not installed in the venv.)
COPY client/ client/
COPY pyproject.toml README.md ./
COPY streamer_service/ streamer_service/
RUN pip install --no-deps ./client . \
    && pip check \
    && python -c "import streamer_service.daemon.server, streamer_service.daemon.api, streamer_service.daemon.core, streamer_client._copier" \
    && streamer-service --help > /dev/null

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG STREAMER_UID=10001
ARG STREAMER_GID=10001
# Pass the real ones when building a release:
#   docker build --build-arg REVISION="$(git rev-parse HEAD)" --build-arg SOURCE=<repository URL> .
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
ARG PYTHON_IMAGE

# OCI image annotations (https://github.com/opencontainers/image-spec/blob/main/annotations.md).
LABEL org.opencontainers.image.title="streamer-service" \
      org.opencontainers.image.description="Per-node checkpoint streaming daemon: object storage to shared memory, once per node" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"

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
    STREAMER_BUILD_REVISION=${REVISION} \
    STREAMER_SOCKET=/run/streamer/daemon.sock \
    STREAMER_SHM_DIR=/dev/shm \
    STREAMER_CACHE_DIR=/var/cache/streamer-service

# Numeric, so Kubernetes' runAsNonRoot can verify it without a runAsUser.
USER 10001:10001
WORKDIR /tmp

# The API is on the unix socket, and the metrics listener is off unless --metrics-port is
# given: the check is the CLI, which asks /readyz (it imports neither torch nor the daemon).
HEALTHCHECK --interval=30s --timeout=15s --start-period=60s --retries=3 \
    CMD ["streamer-service", "health", "--ready"]

# Extra flags go after the image name: docker run ... streamer-service serve --allow s3://bucket/models/
ENTRYPOINT ["streamer-service"]
CMD ["serve"]
