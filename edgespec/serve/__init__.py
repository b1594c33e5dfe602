"""``edgespec serve``: an OpenAI-compatible HTTP server over one exported pair.

Needs the serve extra (``pip install "edgespec[serve]"``: Starlette, uvicorn, pydantic,
Jinja2); the runtime does not import it.
"""

from edgespec.serve.app import build_app

__all__ = ["build_app"]
