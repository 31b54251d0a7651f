"""Bytes and files: the host arena (and, later, disk slabs)."""
