"""Named model pairs: the demo pair bundled with edgespec, and the recipe that rebuilds it."""

from __future__ import annotations

import re
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.manifest import MANIFEST_NAME

DEMO_PACKAGE = Path(__file__).parent / "demo"
# gguf_blocks reads a manifest's counts of GGUF types: names as GGUF spells them, sane counts
_KIND = re.compile(r"[A-Z][A-Z0-9_]{0,11}")
_KINDS, _COUNT = 16, 10**6


def demo_package() -> Path:
    """The exported demo pair inside the installed package."""
    if not (DEMO_PACKAGE / MANIFEST_NAME).is_file():
        raise EdgespecError(
            f"the bundled demo pair is missing from {DEMO_PACKAGE}; pass a package folder, "
            "or rebuild it with 'edgespec models build-demo'"
        )
    return DEMO_PACKAGE


def describe_pairs() -> list[str]:
    """Lines for ``edgespec models list``: each bundled pair, its size, where it lives."""
    import json

    from edgespec.manifest import REPORT_NAME

    path = demo_package()
    lines = describe_package("demo", path)
    report_path = path / REPORT_NAME
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        lines.append(
            f"      trained on the Python {report['python_version']} standard library: held-out "
            f"perplexity {report['target']['heldout_perplexity']:.1f} (target), "
            f"{report['draft']['heldout_perplexity']:.1f} (draft); draft greedy agreement "
            f"{report['greedy_agreement']:.0%}"
        )
    return lines


def describe_package(name: str, path: Path) -> list[str]:
    """Two lines for one package: its size and place, then its models (or "target only")."""
    from edgespec.manifest import Manifest

    manifest = Manifest.read(path)
    size = sum(_size(f) for f in Path(path).rglob("*"))
    draft = manifest.draft
    kind = "an EAGLE-3 head, " if draft and draft.architecture == "eagle3" else ""
    drafting = (f"draft {kind}{draft.layers} layers, {draft.parameters / 1e6:.1f}M" if draft
                else "no draft: target only (decodes with n-gram drafting)")
    target = manifest.target
    return [
        f"{name}  {size / 1e6:.0f} MB  {path}",
        f"      target {target.architecture} {target.layers} layers, "
        f"{target.parameters / 1e6:.1f}M parameters; {drafting}; vocabulary "
        f"{manifest.vocab_size}, context {manifest.max_positions}",
        f"      target {target.quantization or target.dtype}"
        + (f" computing in {target.compute}" if target.quantization else "")
        + (f", runs of at least {target.min_run_tokens} tokens: greedy output with and without "
           "drafting is the same bit for bit" if target.min_run_tokens > 1 else
           ", runs as fed: greedy output with and without drafting is the same up to float "
           "rounding of near-ties")
        + (f"; draft scores {draft.vocab_size:,} of the tokens" if draft and draft.token_ids
           else ""),
        *(f"      {role} from GGUF: {taken}" for role, spec in (("target", target),
                                                            ("draft", draft))
          if spec is not None and (taken := gguf_blocks(spec.validation))),
    ]


def _size(path: Path) -> int:
    """A file's bytes; 0 for what is not a file or cannot be read (gone, forbidden)."""
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


def gguf_blocks(validation) -> str:
    """How a model read from GGUF took the file's matrices, from its manifest's record: "169
    Q4_K, 29 Q6_K kept as the file's blocks", with "29 Q6_K requantized (int4)" (read as
    floats for --quantize or --draft-quantize; else "dequantized"; "its float matrices
    quantized (int8)" when none of a block type was read as floats); "" for a model of another
    source. A manifest may come from anyone: only counts of names spelled as GGUF's types are
    read, at most _KINDS of them."""
    record = validation.get("gguf") if isinstance(validation, dict) else None
    tensors = record.get("tensors") if isinstance(record, dict) else None
    if not isinstance(tensors, dict):
        return ""

    def counted(how: str) -> str:
        kinds = tensors.get(how)
        if not isinstance(kinds, dict):
            return ""
        named = [(count, kind) for kind, count in list(kinds.items())[:_KINDS]
                 if isinstance(kind, str) and _KIND.fullmatch(kind) and
                 type(count) is int and 0 < count < _COUNT]
        return ", ".join(f"{count} {kind}" for count, kind in named)

    kept, read = counted("repacked"), counted("dequantized")
    quantized = record.get("quantization") if record.get("requantized") is True else None
    quantized = quantized if quantized in ("int4", "int8") else None
    parts = [f"{kept} kept as the file's blocks" if kept else "",
             f"{read} {f'requantized ({quantized})' if quantized else 'dequantized'}" if read
             else f"its float matrices quantized ({quantized})" if quantized else ""]
    return "; ".join(part for part in parts if part)
