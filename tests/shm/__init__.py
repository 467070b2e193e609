"""kvoffload.shm: names, mounts, owner records."""
