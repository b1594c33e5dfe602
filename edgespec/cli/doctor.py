"""``edgespec doctor``: what this machine is to edgespec, in lines to paste into a bug report."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import click

from edgespec.cli.base import loader, main, resolve_package, user_errors


@main.command()
@click.argument("packages", nargs=-1, type=click.Path(path_type=Path))
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda", "tensorrt"]),
              default="auto", show_default=True, help="Where the packages' models run.")
@user_errors
def doctor(packages: tuple[Path, ...], provider: str) -> None:
    """The CPU's instruction sets as this process sees them, onnxruntime's build and providers,
    the threads, and for each installed package (the demo pair, the built named models, and
    any PACKAGES) the run shapes its load chose on this machine and whether anything fell back.
    """
    import onnxruntime as ort

    from edgespec import __version__
    from edgespec.models.registry import MODELS, built_package

    from edgespec.manifest import Manifest

    given = {str(p): resolve_package(p) for p in packages}
    for path in given.values():  # a wrong path fails first, in one line of its own
        Manifest.read(path)
    load = loader()  # the runtime imported while signals wait
    from edgespec.runtime import machine, providers

    click.echo(f"edgespec {__version__}, Python {platform.python_version()}, "
               f"{platform.platform()}")
    isa = ", ".join(machine.instruction_sets()) or "none read"
    click.echo(f"CPU: {machine.cpu_model()} ({platform.machine()}), {machine.usable_cores()} "
               f"usable cores; instruction sets: {isa}")
    builds = ", ".join(providers.INSTALLED_BUILDS) or machine.onnxruntime_build()
    click.echo(f"onnxruntime: {builds}; providers: {', '.join(ort.get_available_providers())}")
    if len(providers.INSTALLED_BUILDS) > 1:
        click.echo("warning: several onnxruntime builds are installed over one another; keep "
                   "one (docs/providers.md: GPUs)", err=True)
    found = {"demo": resolve_package(None)}
    found |= {name: path for name in MODELS if (path := built_package(name)) is not None}
    found |= given
    for name, path in found.items():
        start = time.perf_counter()
        pipe = load(path, provider=provider)
        loaded = time.perf_counter() - start
        threads = ", ".join(f"{role} {config.threads or 'all'}"
                            for role, config in pipe.session_configs.items())
        numerics = pipe.numerics
        how = ("checked now" if numerics.source == "measured"
               else "checked before (the calibration cache)")
        click.echo(f"{name} ({path}): loaded in {loaded:.1f} s, threads {threads}, "
                   f"providers {pipe.target.providers[0]}")
        click.echo(f"  {numerics.line()} [{how}]")
        fell = "; ".join(numerics.warnings()) if numerics.fell_back else "nothing"
        click.echo(f"  fell back: {fell}")
