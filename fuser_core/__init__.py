"""Foldwise's core: specs, derivation, certificate, reference and code generation."""

__version__ = "0.1.0"  # the project's version (pyproject.toml reads it from here)
