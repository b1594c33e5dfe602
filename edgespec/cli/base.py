"""The ``edgespec`` group and what its commands share: signals and exit codes, library errors
as one line, and the imports of the extras (each said how to install when missing)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import sys
import warnings
from pathlib import Path

import click

from edgespec.errors import ConfigError, EdgespecError


# Whether this process is the ``edgespec`` command's own (``entry``): its packages are then
# loaded with both models on one pool of worker threads (edgespec.load's shared_pool), which
# every onnxruntime session of a process must then use: a process that imports the commands
# (a test's CliRunner) keeps the library's choice.
_OWN_PROCESS = False


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so that cleanup runs as it does for Ctrl-C."""


def entry() -> None:
    """The ``edgespec`` console script: the commands, with signals and exit codes handled.

    Ctrl-C exits 130 and SIGTERM 143 (128 + the signal's number, as shells report them), with
    one line and no traceback, after every ``finally`` has run (an export removes its temporary
    folder). A closed stdout (``| head``) ends quietly.
    """
    global _OWN_PROCESS
    signal.signal(signal.SIGTERM, _terminate)
    _OWN_PROCESS = True
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__, KeyboardInterrupt):
            _exit("interrupted", 130)
        _exit("Aborted!", 1)
    except KeyboardInterrupt:
        _exit("interrupted", 130)
    except Terminated:
        _exit("terminated", 143)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(1)


def _terminate(signum, frame) -> None:
    raise Terminated()


def _exit(message: str, code: int) -> None:
    """Say why, then leave at once with ``code``: every ``finally`` has already run.

    Not ``sys.exit``: CPython remembers a KeyboardInterrupt raised inside code it ran for a
    library during start-up, and then ends the process by SIGINT (status -2) instead of 130.
    """
    click.echo(message, err=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def user_errors(command):
    """Library errors (EdgespecError: bad packages, settings, prompts) become one line on
    stderr and exit code 1. Nothing else is translated: any other exception is a bug in
    edgespec and keeps its traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            try:
                return command(*args, **kwargs)
            except EdgespecError as e:
                raise click.ClickException(str(e)) from None

    return wrapper


def _one_line_warning(message, category, *args, **kwargs) -> None:
    click.echo(f"warning: {message}", err=True)


def needs_export_extra(module: str):
    """Import a module that needs torch/transformers/optimum, or say how to install them."""
    try:
        with _signals_held():
            import onnx  # noqa: F401  (C extensions: imported here, where signals wait)

            return importlib.import_module(module)
    except ImportError as e:
        raise click.ClickException(
            f"this command needs the export extra ({e.name} is missing): "
            "pip install 'edgespec[export]'"
        ) from None


SERVE_MODULES = ("starlette", "uvicorn", "pydantic", "prometheus_client")  # what the serve extra installs


def needs_serve_extra():
    """edgespec.serve, or one line saying how to install what it needs."""
    try:
        for module in SERVE_MODULES:
            importlib.import_module(module)
        import edgespec.serve.server

        return edgespec.serve
    except ImportError as e:
        raise click.ClickException(
            f"edgespec serve needs the serve extra ({e.name} is missing): "
            'pip install "edgespec[serve]"'
        ) from None


def runtime():
    """edgespec.runtime (onnxruntime, NumPy, tokenizers), imported while signals wait."""
    with _signals_held():
        import edgespec.runtime

        return edgespec.runtime


def loader():
    """``edgespec.load`` (edgespec/loading.py), the runtime imported while signals wait."""
    runtime()
    from edgespec.loading import load

    return functools.partial(load, shared_pool=True) if _OWN_PROCESS else load


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C and SIGTERM while C extensions import: an import interrupted half-way can
    crash the interpreter (seen with onnx's). A signal that arrives meanwhile is delivered,
    and handled as usual, as soon as the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Group(click.Group):
    """The group, keeping the arguments it was given (``given_args``) for the commands that
    record how they were run: ``sys.argv`` is another program's where one calls ``main``."""

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)
        context = super().make_context(info_name, args, parent, **extra)
        context.meta["edgespec.args"] = given
        return context


def given_args() -> list[str]:
    """The arguments the running ``edgespec`` command was given, after its name."""
    return list(click.get_current_context().meta["edgespec.args"])


@click.group(cls=_Group)
@click.version_option(package_name="edgespec")
def main() -> None:
    """Speculative decoding for on-device language models on ONNX Runtime."""


def demo_package() -> Path:
    """The bundled demo pair's package, which a command without PACKAGE uses."""
    from edgespec import models

    return models.demo_package()


def resolve_package(package: Path | None) -> Path:
    """PACKAGE as a command was given it: None, the demo pair; a path, as it is; the name of a
    real model that is not also a path here (``edgespec models list``), its package, built
    into the cache folder on first use with progress lines (needs the export extra)."""
    from edgespec.models import fetch, registry

    if package is None:
        return demo_package()
    name = str(package)
    if package.exists() or name not in registry.MODELS:
        return registry.package_path(package)  # a folder, or a typo's close name refused
    built = registry.built_package(name)
    if built is not None:
        return built
    needs_export_extra("edgespec.export.package")
    model = registry.MODELS[name]
    click.echo(f"{model.title} is not built yet: building it once into "
               f"{registry.models_folder() / name} (edgespec models build {name})", err=True)
    return fetch.build(name, progress=lambda line: click.echo(line, err=True))


def check_chat_template(package: Path | None) -> Path:
    """The package to chat with (None: the demo's), refused at once if it has no chat
    template (runtime/chat.py says what to do): before the slow load, and for the demo pair
    with what to do instead."""
    from edgespec.manifest import Manifest

    path = resolve_package(package)
    manifest = Manifest.read(path)
    if manifest.chat_template is None and package is None:
        raise click.ClickException(
            "the bundled demo pair is a code model without a chat template; pass a package "
            "exported from an instruct checkpoint (edgespec chat PKG), or continue code "
            "with edgespec generate \"def fibonacci(n):\"")
    runtime().chat.load_chat_template(path, manifest)
    return path


def sampling_options(command):
    """The sampling options of ``generate`` and ``chat`` (each None unless given: the request,
    else the package's defaults, else greedy, in that order)."""
    options = [
        click.option("--temperature", "-t", type=float,
                     help="0 is greedy. [default: the package's, else 0]"),
        click.option("--top-k", type=int,
                     help="0 keeps all tokens. [default: the package's, else 0]"),
        click.option("--top-p", type=float,
                     help="1 keeps all tokens. [default: the package's, else 1]"),
        click.option("--min-p", type=float,
                     help="Keep tokens at least this likely relative to the likeliest "
                          "(llama.cpp's min-p, at temperature 1); 0 keeps all. [default: the "
                          "package's, else 0]"),
        click.option("--repetition-penalty", type=float,
                     help="Divide the positive logits of tokens already in the text by this, "
                          "multiply the negative ones (transformers'); 1 is none. [default: "
                          "the package's, else 1]"),
        click.option("--presence-penalty", type=float,
                     help="Subtract this from the logits of tokens generated at least once "
                          "(OpenAI's, -2..2). [default: 0]"),
        click.option("--frequency-penalty", type=float,
                     help="Subtract this times its count from each generated token's logit "
                          "(OpenAI's, -2..2). [default: 0]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def constraint_options(command):
    """--json-schema, --json-object, --regex and --grammar: what the text must match (at most
    one; ``constraint_from`` makes the config.Constraint)."""
    options = [
        click.option("--json-schema", type=click.Path(dir_okay=False, path_type=Path),
                     help="Answer with JSON that fits the JSON schema in this file."),
        click.option("--json-object", is_flag=True, help="Answer with a JSON object."),
        click.option("--regex", help="Answer with text that matches this regular expression "
                                     "(Rust's regex syntax)."),
        click.option("--grammar", type=click.Path(dir_okay=False, path_type=Path),
                     help="Answer with text in this grammar: Lark syntax, or llama.cpp's GBNF "
                          "for a file ending in .gbnf."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def constraint_from(json_schema: Path | None, json_object: bool, regex: str | None,
                    grammar: Path | None):
    """The config.Constraint the options ask for, None for free text; one line for a file
    that does not read or a second option given."""
    from edgespec.config import MAX_CONSTRAINT_CHARS, Constraint

    given = [name for name, value in (("--json-schema", json_schema), ("--json-object",
             json_object), ("--regex", regex), ("--grammar", grammar)) if value]
    if len(given) > 1:
        raise click.ClickException(f"{' and '.join(given)} each constrain the whole answer; "
                                   "give one")

    def read(path: Path) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_CONSTRAINT_CHARS + 1)
        except (OSError, UnicodeDecodeError) as e:
            raise click.ClickException(f"cannot read {path} ({e.__class__.__name__}: "
                                       f"{getattr(e, 'strerror', None) or e})") from None
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise click.ClickException(f"{path} is longer than {MAX_CONSTRAINT_CHARS:,} "
                                       "characters; no schema or grammar needs that")
        return text

    if json_schema:
        try:
            return Constraint.json_schema(read(json_schema))
        except ConfigError as e:
            raise click.ClickException(f"{json_schema}: {e}") from None
    if json_object:
        return Constraint("json_object")
    if regex:
        return Constraint("regex", regex)
    if grammar:
        return Constraint("gbnf" if grammar.suffix == ".gbnf" else "lark", read(grammar))
    return None


def sampling_line(given: dict, package: dict) -> str:
    """"sampling: ..." as config.describe_sampling says it, with how to sample where the
    fallback (greedy) was taken."""
    from edgespec.config import describe_sampling

    line = f"sampling: {describe_sampling(given, package)}"
    if not package and all(value is None for value in given.values()):
        line += "; --temperature 0.7 to sample"
    return line
