"""The whole system: packaging, install, deploy files, image, docs, bench, the agent end to end."""
