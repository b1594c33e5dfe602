"""Hugging Face checkpoints and GGUF files -> an edgespec package. The only part that imports
torch, and only when ``export_pair`` is first used: the argument and header checks
(destination.py, gguf_header.py) answer before the slow imports."""


def __getattr__(name: str):
    if name == "export_pair":
        from edgespec.export.package import export_pair

        return export_pair
    raise AttributeError(f"module 'edgespec.export' has no attribute {name!r}")


__all__ = ["export_pair"]
