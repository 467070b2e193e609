#!/bin/sh
# Container entrypoint for vLLM with CPU KV offload. An in-place restart (Docker
# `restart: unless-stopped`, a Kubernetes container restart with an emptyDir /dev/shm) keeps
# /dev/shm, and the dead engine's region with it (vLLM #54002: permanent CrashLoopBackOff).
# Before the engine starts, remove regions that no process in this container's view holds.
# `--grace 0s` is right here because no engine of ours is running yet; keep the default if
# other containers share this /dev/shm and may be starting right now.
set -eu
shmctl reap --yes --grace "${SHMCTL_GRACE:-0s}" || {
    rc=$?
    # 3 = could not inspect (permissions): start anyway, the engine will say if space is short.
    [ "$rc" -eq 3 ] || exit "$rc"
}
exec "$@"
