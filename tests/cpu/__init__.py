"""kvoffload.cpu: the region, its pre-fault, the managers and policies, the worker."""
