#!/bin/sh
# `shmctl` in an image whose Python is not the one shmctl was installed with (the vLLM image of
# deploy/docker/vllm.Dockerfile). shmctl and its dependencies are pure Python, installed apart
# in /opt/shmctl/lib, and run on the image's own python3 (3.11 or later). PYTHONPATH is set for
# this process alone, so the engine never imports shmctl's pinned packages in place of its own;
# -P keeps the working directory off sys.path.
PYTHONPATH=/opt/shmctl/lib exec python3 -P -m shmctl "$@"
