"""Byte units, defined once for every module."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
