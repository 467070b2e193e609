"""One-line summaries and EXAMPLES of every command: ``--help``, the man page and the README's
table read them from here.

A summary fits the command list of ``shmctl --help`` on an 80-column terminal whole (click cuts
longer ones mid-phrase with "..."); a test holds every summary to that. Examples are what an
operator types, with the safe defaults (no zero grace, a dry run before a removal); a test parses
every one with the command's own parser, so an example cannot name a flag that does not exist.
"""

from __future__ import annotations

#: Longest summary that ``shmctl --help`` prints on one line at 80 columns.
SUMMARY_LIMIT = 60

SUMMARIES = {
    "scan": "Which region files are live or orphaned, and why.",
    "reap": "Remove only the region files proven dead; dry-run first.",
    "init": "Rehearse vLLM's offload bring-up: plan, run, inject a fault.",
    "faults": "List the fault points that init --fail-at accepts.",
    "audit": "Run a command; fail if it leaves shared memory behind.",
    "metrics": "Prometheus metrics of a root, on stdout or as a textfile.",
    "watch": "The node agent: watch every pod's /dev/shm, serve metrics.",
    "doctor": "Check this node for what shmctl and vLLM's offload need.",
    "completion": "Print the completion script for bash, zsh or fish.",
    "man": "Print the man page, shmctl(1), as roff.",
}

#: ``shmctl --help``'s own examples: the three commands to run on a node now.
ROOT_EXAMPLES = (
    ("sudo shmctl scan", "what is in /dev/shm, and what is dead"),
    ("sudo shmctl reap --dry-run", "what reap would remove, with the evidence"),
    ("sudo shmctl reap --all-users --yes", "remove only what is proven dead"),
    ("shmctl doctor", "is this node ready for vLLM's offload and for shmctl"),
)

EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "scan": (
        ("shmctl scan", "the default root, /dev/shm; exit 1 when something is orphaned"),
        ("shmctl scan --root /dev/shm --json", "one JSON document (schema: scan)"),
        ("shmctl scan --deleted", "also regions unlinked but still mapped"),
        ("shmctl scan --no-headers --bytes", "rows only, exact sizes, for awk"),
    ),
    "reap": (
        ("shmctl reap --dry-run", "what would go, and the evidence for each"),
        ("shmctl reap --yes", "remove what is proven dead, without asking"),
        ("shmctl reap --engine ENGINE_ID --dry-run", "one engine's files only"),
        ("shmctl reap --older-than 1h --yes --json", "only orphans untouched for an hour"),
    ),
    "init": (
        ("shmctl init --config engine.json --model llama-3-8b --dry-run", "the plan; does it fit"),
        ("shmctl init --config engine.json --model llama-3-8b --fail-at secondary", "nothing left?"),
        ("shmctl init --config engine.json --model llama-3-8b --hold", "up until Ctrl-C or SIGTERM"),
        ("shmctl init --config engine.json --model llama-3-8b --matrix", "every stage x every mode"),
        ('shmctl init --kv-transfer-config "$KV_CONFIG" --model llama-3-8b', "vLLM's JSON, verbatim"),
        (
            "shmctl init --config engine.json --engine vllm --model ./model --fail-at secondary",
            "inside a real vLLM engine",
        ),
    ),
    "faults": (
        ("shmctl faults", "every point, in stage order"),
        ("shmctl faults --json", "the same as one JSON document"),
    ),
    "audit": (
        ("shmctl audit -- python serve.py", "fail (exit 1) if it leaves a region behind"),
        ("shmctl audit --report audit.json --junit junit.xml -- pytest", "reports for CI"),
        ("shmctl audit --settle 2s -- ./start-engine.sh", "wait for late cleanup first"),
    ),
    "metrics": (
        ("shmctl metrics", "the exposition on stdout"),
        ("shmctl metrics --textfile /var/lib/prometheus/node-exporter", "for node_exporter"),
    ),
    "watch": (
        ("shmctl watch --root '/dev/shm' --once", "one pass, events on stdout"),
        ("shmctl watch --listen 127.0.0.1:9477", "serve /metrics and /healthz"),
        (
            "shmctl watch --root '/var/lib/kubelet/pods/*/volumes/kubernetes.io~empty-dir/*' --reap",
            "every pod's /dev/shm",
        ),
    ),
    "doctor": (
        ("shmctl doctor", "one verdict per check, with the fix"),
        ("shmctl doctor --plan engine.json --model llama-3-70b --world-size 4", "will it fit"),
        ("shmctl doctor --need 200g --need 200g", "two regions of 200 GiB"),
        ("shmctl doctor --json | jq '.checks[] | select(.status != \"ok\")'", "what is not ok"),
    ),
    "completion": (
        ("source <(shmctl completion bash)", "in ~/.bashrc: completion in every new bash"),
        ('shmctl completion zsh > "${fpath[1]}/_shmctl"', "zsh: once, then compinit finds it"),
        ("shmctl completion fish | source", "in ~/.config/fish/config.fish"),
    ),
    "man": (
        ("shmctl man | man -l -", "read it, from any install"),
        ("shmctl man > ~/.local/share/man/man1/shmctl.1", "pipx: then `man shmctl` finds it too"),
    ),
}


def epilog(examples: tuple[tuple[str, str], ...]) -> str:
    """An EXAMPLES block that click prints as written (``\\b``: no rewrapping): what each does
    as a comment, then the command, so a long command line still pastes as one line."""
    lines = []
    for command, what in examples:
        lines += [f"  # {what}", f"  $ {command}"]
    return "Examples:\n\n\b\n" + "\n".join(lines)
