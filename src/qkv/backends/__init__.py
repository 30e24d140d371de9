"""Backends: one module each, registered in qkv.dispatch."""
