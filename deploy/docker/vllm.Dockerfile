# A vLLM image with shmctl and its entrypoint wrapper: what the `vllm` container of
# deploy/kubernetes/vllm-with-shmctl.yaml runs. Built from the repository root, on the vLLM
# image you choose (there is no default: pick the release you run, pinned):
#
#   make image VLLM_IMAGE=docker.io/vllm/vllm-openai:vX.Y.Z    # also tags vllm-with-shmctl:VERSION
#   docker build -f deploy/docker/vllm.Dockerfile \
#       --build-arg VLLM_IMAGE=docker.io/vllm/vllm-openai:vX.Y.Z -t vllm-with-shmctl:0.1.0 .
#
# shmctl goes beside vLLM, not into its environment: its pure-Python packages (the pinned,
# hashed deploy/docker/requirements.txt and the shmctl wheel) are installed apart in
# /opt/shmctl/lib and run on the vLLM image's own python3 (3.11 or later) through
# /usr/local/bin/shmctl (deploy/docker/shmctl-launcher.sh; the console scripts pip writes would
# name the build stage's interpreter, so they are removed), so no package vLLM imports (rich,
# prometheus-client, ...) is upgraded or downgraded under it, and the vLLM image needs no pip.

# The same pinned base as ../../Dockerfile; it only builds, nothing of it is in the result.
ARG PYTHON_IMAGE=docker.io/library/python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
ARG VLLM_IMAGE

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY deploy/docker/requirements.txt deploy/docker/build-requirements.txt deploy/docker/
# --no-compile: bytecode for this Python would not be the vLLM image's.
RUN python -m pip install --no-cache-dir --require-hashes -r deploy/docker/build-requirements.txt \
 && python -m pip install --no-cache-dir --no-compile --require-hashes --target /opt/shmctl/lib \
        -r deploy/docker/requirements.txt
COPY pyproject.toml README.md LICENSE ./
COPY kvoffload/ kvoffload/
COPY shmctl/ shmctl/
COPY man/shmctl.1 man/
COPY completions/ completions/
COPY scripts/install-units.sh scripts/
COPY deploy/systemd/ deploy/systemd/
RUN python -m pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
 && python -m pip install --no-cache-dir --no-compile --no-deps --no-index --target /opt/shmctl/lib \
        /wheels/shmctl-*.whl \
 && rm -r /opt/shmctl/lib/bin \
 && PYTHONPATH=/opt/shmctl/lib python -P -m shmctl --version

FROM ${VLLM_IMAGE}
COPY --from=build /opt/shmctl/lib /opt/shmctl/lib
COPY deploy/docker/shmctl-launcher.sh /usr/local/bin/shmctl
COPY deploy/docker/entrypoint.sh /usr/local/bin/shmctl-entrypoint.sh
