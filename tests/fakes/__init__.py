"""Faithful stand-ins for hardware this machine lacks, for tests only (never part of the package)."""
