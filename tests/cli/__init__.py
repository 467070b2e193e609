"""The shmctl CLI: conventions, errors, help, completions, rendering, each command's output."""
