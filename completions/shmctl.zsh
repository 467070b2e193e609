#compdef shmctl

_shmctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _SHMCTL_COMPLETE=complete_zsh shmctl)
}

compdef _shmctl_completion shmctl
