#!/usr/bin/env bash
# `make demo`: the main job end to end, on a private root under /dev/shm so nothing of the
# host's is touched. Plan -> real bring-up -> injected failure (contract holds) -> a crash
# with vLLM's lifetime leaves an orphan -> scan finds it -> reap removes it.
set -euo pipefail

ROOT=$(mktemp -d /dev/shm/shmctl-demo.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
export SHMCTL_ROOT=$ROOT

# One line, so that each command echoed below pastes as one line.
CONFIG='{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
CONFIG+='"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 268435456, '
CONFIG+='"secondary_tiers": [{"type": "example"}], "my_plugin_knob": 1}}'
# --root on every command (not only SHMCTL_ROOT): a command copied from the output acts on the
# demo's root, never on the host's /dev/shm.
ENGINE=(--root "$ROOT" --kv-transfer-config "$CONFIG" --model llama-3-8b --world-size 2)

# Titles in bold on a terminal only: a pipe or a log gets no escape sequences (NO_COLOR and
# TERM=dumb take the bold away too, as they take shmctl's colour away).
BOLD='' PLAIN=''
if [ -t 1 ] && [ -z "${NO_COLOR:-}" ] && [ "${TERM:-dumb}" != dumb ]; then
    BOLD=$'\033[1m' PLAIN=$'\033[0m'
fi

quoted() {  # quoted WORD...: the words as a shell reads them back, each quoted only if it must be
    local word out=()
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
            out+=("$word")
        else
            out+=("'${word//\'/\'\\\'\'}'")
        fi
    done
    printf '%s' "${out[*]}"
}

step() {  # step EXPECTED_EXIT TITLE -- COMMAND...
    local expected=$1 title=$2
    shift 3
    printf '\n%s== %s%s\n$ %s\n' "$BOLD" "$title" "$PLAIN" "$(quoted "$@")"
    local rc=0
    "$@" || rc=$?
    if [ "$rc" -ne "$expected" ]; then
        echo "demo: expected exit $expected, got $rc" >&2
        exit 1
    fi
    echo "(exit $rc)"
}

step 0 "1. What would vLLM allocate? (dry run: nothing is created)" -- \
    shmctl init "${ENGINE[@]}" --dry-run
step 0 "2. Real bring-up: 2 worker processes, then the scheduler, a round trip, teardown" -- \
    shmctl init "${ENGINE[@]}"
step 0 "3. Inject a failure while building the secondary tier: the cleanup contract holds" -- \
    shmctl init "${ENGINE[@]}" --fail-at secondary --fail-mode cleanup-raise
step 1 "4. Crash (SIGKILL everyone) at the same stage with vLLM 0.33's tiering lifetime" -- \
    shmctl init "${ENGINE[@]}" --lifetime vllm --fail-at secondary --fail-mode crash
step 1 "5. shmctl scan: the crash left an orphan" -- \
    shmctl scan --root "$ROOT" --grace 0s
step 0 "6. shmctl reap removes it, and only it" -- \
    shmctl reap --root "$ROOT" --yes --grace 0s
step 0 "7. Clean again" -- \
    shmctl scan --root "$ROOT" --grace 0s
printf '\ndemo: all steps behaved as expected\n'
