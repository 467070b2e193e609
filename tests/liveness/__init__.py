"""kvoffload.liveness: evidence, verdicts, scan, park directories, reap, audit."""
