"""The shell completion scripts that ``shmctl completion SHELL`` prints and completions/ holds.

One text per shell, held here as data so that printing one needs neither typer nor any command
(``shmctl.launch`` answers ``shmctl completion SHELL`` from this module alone: a shell's rc file
runs it at every start). ``scripts/gen_completions.py`` writes the same texts into completions/
under the names each shell looks up, and the wheel installs those files; tests compare all three.

Every Tab still runs ``shmctl`` itself (typer's protocol, ``_SHMCTL_COMPLETE``), so what is
offered is live: commands, options, engine ids in the root, fault points. The bash and fish
texts are typer's own scripts for ``shmctl``, byte for byte; the zsh text is typer's function
with an ending that works both ways a zsh user loads it (see ``ZSH``). A test compares them with
what ``shmctl --show-completion SHELL`` prints, so a typer that changes its protocol is noticed.
"""

from __future__ import annotations

#: The shells ``shmctl completion`` writes for, in the order its help and errors list them.
SHELLS = ("bash", "zsh", "fish")

BASH = """\
_shmctl_completion() {
    local IFS=$'
'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \\
                   COMP_CWORD=$COMP_CWORD \\
                   _SHMCTL_COMPLETE=complete_bash $1 ) )
    return 0
}

complete -o default -F _shmctl_completion shmctl
"""

#: compinit reads the ``#compdef`` line of a file on ``$fpath`` and, on the first Tab, autoloads
#: the file's body as the function ``_shmctl`` and calls it, so that body has to complete
#: (``funcstack[1]`` is then ``_shmctl``). Sourced (``source <(shmctl completion zsh)``) it binds
#: the function with compdef instead, as typer's own script does; typer's script, autoloaded,
#: would bind on the first Tab and leave it with nothing.
ZSH = """\
#compdef shmctl
# zsh completion for shmctl (`shmctl completion zsh` prints it). Either save it as _shmctl in a
# directory on $fpath before compinit runs (pip installs it in PREFIX/share/zsh/site-functions),
# or source it after compinit. typer's completion function, called when compinit autoloads the
# file (so that the first Tab completes too) and bound with compdef when the file is sourced.

_shmctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _SHMCTL_COMPLETE=complete_zsh shmctl)
}

if [[ ${funcstack[1]-} == _shmctl ]]; then
  _shmctl_completion "$@"
else
  compdef _shmctl_completion shmctl
fi
"""

FISH = (
    'complete --command shmctl --no-files --arguments "(env _SHMCTL_COMPLETE=complete_fish '
    '_TYPER_COMPLETE_FISH_ACTION=get-args _TYPER_COMPLETE_ARGS=(commandline -cp) shmctl)" '
    '--condition "env _SHMCTL_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=is-args '
    '_TYPER_COMPLETE_ARGS=(commandline -cp) shmctl"\n'
)

#: Each shell's script, by the name ``shmctl completion`` takes.
SCRIPTS = {"bash": BASH, "zsh": ZSH, "fish": FISH}
