"""The node agent (shmctl watch): roots, passes, events, HTTP, memory, soak."""
