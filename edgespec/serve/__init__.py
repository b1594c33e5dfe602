"""``edgespec serve``: an OpenAI-compatible HTTP server over one exported pair.

Needs the serve extra (``pip install "edgespec[serve]"``: Starlette, uvicorn, pydantic,
Jinja2, prometheus_client); the runtime does not import it. ``build_app`` is imported on first
use, so that the template-rendering child (render.py) starts without the server's imports.
"""

__all__ = ["ServeConfig", "build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from edgespec.serve.app import build_app

        return build_app
    if name == "ServeConfig":
        from edgespec.serve.config import ServeConfig

        return ServeConfig
    raise AttributeError(f"module 'edgespec.serve' has no attribute {name!r}")
