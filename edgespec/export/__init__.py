"""Hugging Face checkpoints -> an edgespec package. The only part that imports torch."""

from edgespec.export.package import export_pair

__all__ = ["export_pair"]
