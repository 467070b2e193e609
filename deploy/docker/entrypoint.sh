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
    # 3 = the root could not be read: start anyway, the engine will say if space is short.
    # (Processes we cannot inspect make files `unknown`: never reaped, exit 0.)
    [ "$rc" -eq 3 ] || exit "$rc"
}
exec "$@"
