"""Envoy ext_proc messages (generated from ext_proc.proto; see generate.py)."""
