"""``edgespec serve``: an OpenAI-compatible HTTP server over one exported pair.

Needs the serve extra (``pip install "edgespec[serve]"``: Starlette, uvicorn, pydantic,
Jinja2, prometheus_client); the runtime does not import it. ``build_app`` is imported on first
use, so that the tokenizing and template-rendering child (runtime/bounded_text.py) starts
without the server's imports.

Trust model. Clients are untrusted: every input is bounded (middleware.py, transport.py, app.py).
A package is a folder someone gave you, and is trusted in part:

- its chat template (Jinja) is data: compiled in a sandbox that caps what one expression may
  build and evaluates nothing while compiling (runtime/chat_template.py), rendered in the
  child process (runtime/bounded_text.py) under an address-space limit (Linux) and a time
  limit, killed past either; a hostile template costs one 400 and a restarted child (the
  library and the command line use the same child: BoundedText);
- its tokenizer's encoding (normalizers and pre-tokenizers, where backtracking regexes live)
  runs in that child too, under the same limits: it cannot hang or bloat the server. Its
  decoder also runs in the server process (the text of generated ids, token healing), and
  its vocabulary is read at load (the longest token bounds a prompt's characters): these
  are trusted, checked only by the load-time probe (runtime/package_checks.py);
- its manifest (edgespec.json) is checked at load: paths stay inside the package, the
  tokenizer matches the fingerprint written at export (if it has one), the graphs' KV inputs and logits
  rows match what it says, one probe run succeeds; a package that fails is refused before
  the server listens;
- its ONNX graphs are code: onnxruntime runs them in the server process with its own
  operators only (no custom-op libraries are loaded), and one ``session.run`` cannot be
  interrupted. A graph that computes slowly or allocates much is trusted as far as
  onnxruntime is; ``--request-timeout`` ends a generation between two runs, not inside one.
  Serve only packages you would run with ``edgespec generate``.
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
