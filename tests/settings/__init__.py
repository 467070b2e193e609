"""Parsing and validation of --kv-transfer-config, and every parser under generated input."""
