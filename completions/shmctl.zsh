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
