"""Every file a docstring or comment in edgespec/ names exists: a rename leaves no stale pointer.

A name is a path ending in .py, .md or .toml (``runtime/session.py``, ``text_process.py``,
``benchmarks/RESULTS.md``). It resolves if some file of the repository ends with it (after a
slash, or as the whole path); names of other projects' files are listed in EXTERNAL.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "edgespec"
NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|toml))(?![\w/])")
# Files of other projects that comments cite for their ideas.
EXTERNAL = {
    "utils/chat_template_utils.py",  # transformers' chat template helpers
    "convert_hf_to_gguf.py",  # llama.cpp's converter
    "vllm/model_executor/models/llama_eagle3.py",  # vLLM's EAGLE-3 head
}


def repository_files() -> list[str]:
    skip = {".git", ".venv", "__pycache__", "node_modules"}
    return ["/" + p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO).parts)]


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(
        io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.append((body[0].lineno, body[0].value.value))
    return found


def missing_names(files: list[str], modules: dict[str, str]) -> list[str]:
    """``module:line: name`` for each name in ``modules``' prose that no file of ``files`` is."""
    missing = []
    for module, source in modules.items():
        for line, text in prose(source):
            for name in NAME.findall(text):
                if name in EXTERNAL or any(f.endswith("/" + name) for f in files):
                    continue
                missing.append(f"{module}:{line}: {name}")
    return missing


def test_every_file_named_in_the_package_exists():
    modules = {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8")
               for p in sorted(PACKAGE.rglob("*.py"))}
    assert missing_names(repository_files(), modules) == []


@pytest.mark.parametrize("text, flagged", [
    ('"""See runtime/session.py and export/runs.py."""', []),
    ('"""The rule is in runtime/nowhere.py."""', ["runtime/nowhere.py"]),
    ("x = 1  # render.py draws it\n", ["render.py"]),
    ('"""Results in benchmarks/RESULTS.md, not benchmarks/RESULTZ.md."""',
     ["benchmarks/RESULTZ.md"]),
    ('"""Names in code are not prose."""\nNAME = "bogus.py"\n', []),
])
def test_the_check_flags_a_bogus_name(text, flagged):
    found = missing_names(repository_files(), {"m.py": text})
    assert [entry.rsplit(" ", 1)[1] for entry in found] == flagged


def layout_sections(readme: str) -> dict[str, str]:
    """README's "## Layout" map: each top-level entry (``bench.py``, ``export/``) -> its text,
    the lines up to the next entry."""
    block = readme.split("## Layout", 1)[1].split("```")[1]
    sections: dict[str, str] = {}
    entry = None
    for line in block.splitlines():
        if re.match(r"  \S", line):
            entry, _, line = line.strip().partition(" ")
            sections[entry] = ""
        if entry is not None:
            sections[entry] += " " + line.strip()
    return sections


def unmapped(modules: list[str], sections: dict[str, str]) -> list[str]:
    """The modules (paths under edgespec/, a package's __init__.py aside: its folder's entry
    says what it is) that the map does not name: a top-level module by its own entry, one
    in a folder by its file name in that folder's entry."""
    missing = []
    for module in modules:
        parts = module.split("/")
        if len(parts) == 1:
            if parts[0] not in sections:
                missing.append(module)
        elif parts[-1] != "__init__.py" and not re.search(
                rf"(?<![\w.]){re.escape(parts[-1])}(?![\w])", sections.get(parts[0] + "/", "")):
            missing.append(module)
    return missing


def test_the_readme_layout_names_every_module():
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    sections = layout_sections((REPO / "README.md").read_text(encoding="utf-8"))
    assert unmapped(modules, sections) == [], "README.md's Layout lacks these modules"


def test_the_layout_check_flags_a_missing_or_misplaced_module():
    sections = layout_sections("## Layout\n\n```\nedgespec/\n  bench.py      edgespec bench\n"
                               "  export/       pair.py (checks),\n                fused.py\n"
                               "  runtime/      session.py\n```\n")
    assert unmapped(["bench.py", "export/pair.py", "export/fused.py", "runtime/__init__.py"],
                    sections) == []
    assert unmapped(["config.py", "export/session.py", "runtime/pair.py", "export/air.py"],
                    sections) == ["config.py", "export/session.py", "runtime/pair.py",
                                  "export/air.py"]


def test_the_readme_states_the_aux_layers_rule_as_the_code_has_it():
    from edgespec.export.aux_layers import RULE

    assert RULE in " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
