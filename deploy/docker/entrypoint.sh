#!/bin/sh
# Container entrypoint for vLLM with CPU KV offload. An in-place restart (Docker
# `restart: unless-stopped`, a Kubernetes container restart with an emptyDir /dev/shm) keeps
# /dev/shm, and the dead engine's region with it (vLLM #54002: permanent CrashLoopBackOff).
# Before the engine starts, remove the regions nobody holds. The write lease proves that
# kernel-wide (any PID namespace, any uid), so this is safe even though this container
# cannot see or inspect every process (its PID 1, a sidecar, the host).
# `--grace 0s` is right here because no engine of ours is running yet; keep the default if
# other containers share this /dev/shm and may be starting right now.
# Files reap cannot prove dead are kept, and it says so on stderr before the engine starts.
# SHMCTL_FAMILIES="psm sem" also removes the dead engine's other files, family by family
# (docs/families.md): `--family offload --family psm --family sem`, the offload regions
# always included (they are what the restart needs). Unset: the offload regions only.
set -eu

reap() {
    # Split on spaces on purpose (family names have none), never globbed; the function's own
    # "$@" gathers the flags, so the engine's command line is left as it is.
    set -f
    for family in ${SHMCTL_FAMILIES:-}; do
        [ "$#" -gt 0 ] || set -- --family offload
        set -- "$@" --family "$family"
    done
    set +f
    shmctl reap --yes --grace "${SHMCTL_GRACE:-0s}" "$@"
}

reap || {
    rc=$?
    # 3 = the root could not be read: start anyway, the engine will say if space is short.
    [ "$rc" -eq 3 ] || exit "$rc"
}
exec "$@"
