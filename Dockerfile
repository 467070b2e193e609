# The shmctl image: `shmctl watch`, the node agent of deploy/kubernetes/daemonset.yaml and the
# sidecar of deploy/kubernetes/vllm-with-shmctl.yaml, and the engine entrypoint wrapper at
# /usr/local/bin/shmctl-entrypoint.sh. No torch: the agent and every command but a real `init`
# run on the core dependencies alone.
#
#   make image                          # docker or podman; tags shmctl:VERSION (pyproject.toml)
#   docker build -t shmctl:0.1.0 .      # the same by hand
#
# Two stages. `build` turns this checkout into a wheel and installs it, with its pinned and
# hashed dependencies (deploy/docker/requirements.txt), into a virtual environment at
# /opt/shmctl that has no pip of its own. The final stage is the same base image with that
# directory copied in: no pip cache, no build tools, no wheel, nothing written at run time.
#
# It runs as uid 0 on purpose (no USER): only uid 0 keeps the capabilities the DaemonSet adds
# (LEASE, DAC_READ_SEARCH), because Kubernetes sets no ambient capabilities. It runs under the
# DaemonSet's security context as it is: read-only root filesystem (the bytecode is compiled at
# build time; the lease watchdog's table is a memfd, so nothing needs /tmp), a PID namespace of
# its own (SIGTERM and SIGINT stop `shmctl watch` cleanly as PID 1; it waits for its own
# children), RuntimeDefault seccomp.

# python:3.11.14-slim-bookworm, pinned by tag and by the digest of its multi-architecture
# index. Bump both together: docker buildx imagetools inspect docker.io/library/python:TAG.
# Fully qualified, so podman resolves it without a short-name prompt.
ARG PYTHON_IMAGE=docker.io/library/python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Dependencies first: this layer is reused until a pin changes, whatever the code does.
# --require-hashes: every package, dependencies included, must be listed with its hash.
COPY deploy/docker/requirements.txt deploy/docker/build-requirements.txt deploy/docker/
RUN python -m venv --without-pip /opt/shmctl \
 && python -m pip install --no-cache-dir --require-hashes -r deploy/docker/build-requirements.txt \
 && python -m pip --python /opt/shmctl/bin/python install --no-cache-dir --require-hashes \
        -r deploy/docker/requirements.txt
# What the wheel is built from: the packages and every file pyproject.toml names (readme,
# licence, man page, completions, the units and their installer).
COPY pyproject.toml README.md LICENSE ./
COPY kvoffload/ kvoffload/
COPY shmctl/ shmctl/
COPY man/shmctl.1 man/
COPY completions/ completions/
COPY scripts/install-units.sh scripts/
COPY deploy/systemd/ deploy/systemd/
# No build isolation: the pinned setuptools above builds it, so pip fetches nothing here.
RUN python -m pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
 && python -m pip --python /opt/shmctl/bin/python install --no-cache-dir --no-deps --no-index \
        /wheels/shmctl-*.whl \
 && python -m pip --python /opt/shmctl/bin/python check \
 && /opt/shmctl/bin/shmctl --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="shmctl" \
      org.opencontainers.image.description="Find and safely reap orphaned vLLM KV-offload regions in /dev/shm: the shmctl watch node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/shmctl /opt/shmctl
# The path deploy/kubernetes/vllm-with-shmctl.yaml runs (its mode, 0755, comes from the checkout).
COPY deploy/docker/entrypoint.sh /usr/local/bin/shmctl-entrypoint.sh
# PYTHONUNBUFFERED: each JSON event line reaches the container log when it is written.
ENV PATH=/opt/shmctl/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["/opt/shmctl/bin/shmctl"]
CMD ["--help"]
