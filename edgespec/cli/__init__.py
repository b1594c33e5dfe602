"""The ``edgespec`` command: parse, build configs, call the library, print. No logic here.

    base.py      the group, signals and exit codes, library errors as one line, the extras
    generate.py  export, generate
    models.py    models (list, build NAME, build-demo), distill (an EAGLE-3 head)
    bench.py     bench
    chat.py      chat
    doctor.py    doctor
    serve.py     serve
"""

from edgespec.cli import bench, chat, doctor, generate, models, serve  # noqa: F401  (each registers its commands)
from edgespec.cli.base import entry, main

__all__ = ["entry", "main"]
