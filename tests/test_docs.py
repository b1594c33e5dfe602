"""The docs hold no stale pointer: every file a docstring or comment in edgespec/ names exists,
docs/layout.md maps every module, every `edgespec ...` command of README.md and docs/ parses
against the real command line, and every relative link there leads to a file (and heading).

A name is a path ending in .py, .md or .toml (``runtime/session.py``, ``text_process.py``,
``benchmarks/RESULTS.md``). It resolves if some file of the repository ends with it (after a
slash, or as the whole path); names of other projects' files are listed in EXTERNAL.
"""

from __future__ import annotations

import ast
import io
import re
import shlex
import tokenize
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "edgespec"
LAYOUT = REPO / "docs" / "layout.md"
# README.md and the manual's pages: what the command, link and layout checks read
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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


def layout_sections(page: str) -> dict[str, str]:
    """The layout map (the first fenced block of docs/layout.md): each top-level entry
    (``bench.py``, ``export/``) -> its text, the lines up to the next entry."""
    block = page.split("```")[1]
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


def test_the_layout_page_names_every_module():
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    sections = layout_sections(LAYOUT.read_text(encoding="utf-8"))
    assert unmapped(modules, sections) == [], "docs/layout.md lacks these modules"


def test_the_layout_check_flags_a_missing_or_misplaced_module():
    sections = layout_sections("## Layout\n\n```\nedgespec/\n  bench.py      edgespec bench\n"
                               "  export/       pair.py (checks),\n                fused.py\n"
                               "  runtime/      session.py\n```\n")
    assert unmapped(["bench.py", "export/pair.py", "export/fused.py", "runtime/__init__.py"],
                    sections) == []
    assert unmapped(["config.py", "export/session.py", "runtime/pair.py", "export/air.py"],
                    sections) == ["config.py", "export/session.py", "runtime/pair.py",
                                  "export/air.py"]


def test_the_export_page_states_the_aux_layers_rule_as_the_code_has_it():
    from edgespec.export.aux_layers import RULE

    page = REPO / "docs" / "export.md"
    assert RULE in " ".join(page.read_text(encoding="utf-8").split())


FENCE = re.compile(r"^[ \t]*```([\w-]*)\n(.*?)^[ \t]*```", re.M | re.S)
# what shlex returns between commands: |, &&, ;, ( ) of $(...), redirections
SEPARATORS = set("|&;()<>")
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def shell_commands(line: str) -> list[list[str]]:
    """The words after ``edgespec`` of each command a shell line runs (``a && edgespec x | y``,
    ``VAR=1 edgespec x``), its comment dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in [*lexer, ";"]:
        if token and set(token) <= SEPARATORS:
            while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                words.pop(0)  # an environment assignment before the command
            if words and words[0] == "edgespec":
                commands.append(words[1:])
            words = []
        else:
            words.append(token)
    return commands


def command_lines(markdown: str) -> list[tuple[str, list[str] | str]]:
    """(the line as written, its words after ``edgespec``) of every edgespec command in the code
    blocks: each line of a ```bash block (continuations joined), and in other blocks each line
    that starts with ``edgespec `` or ``$ ``. A synopsis (``edgespec generate [PKG_DIR] [--seed
    S]``, its indented continuation lines joined) comes as its text: only its option names are
    checked."""
    found: list[tuple[str, list[str] | str]] = []
    for lang, block in FENCE.findall(markdown):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        lines = block.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            line = line.strip()
            if lang == "" and line.startswith("$ "):
                line = line[2:]
            elif lang == "" and not line.startswith("edgespec "):
                continue
            if lang == "" and re.match(r"edgespec [^#]*\[", line):
                rest = [more.strip() for more in lines[i + 1:]]
                line = " ".join([line, *rest[:next((n for n, more in enumerate(rest)
                                                    if not more.startswith("[")), len(rest))]])
                found.append((line, line))
                continue
            found.extend((line, words) for words in shell_commands(line))
    return found


def option_names(command: click.Command) -> set[str]:
    return {name for p in command.params if isinstance(p, click.Option)
            for name in (*p.opts, *p.secondary_opts)}


def command_problem(group: click.Group, words: list[str] | str) -> str | None:
    """What is wrong with ``edgespec WORDS`` against the command line ``group`` (a subcommand
    that does not exist, an option it does not define, a missing option value, a value outside
    an option's choices), or None. Parses only: nothing runs, so placeholders (PKG, OUT) are
    fine as arguments."""
    synopsis = isinstance(words, str)
    args = shlex.split(words)[1:] if synopsis else list(words)
    command: click.Command = group
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):
        name = args.pop(0)
        sub = command.get_command(click.Context(command), name)
        if sub is None:
            return f"no subcommand {name!r}"
        command = sub
    if synopsis:
        unknown = sorted(set(OPTION.findall(" ".join(args))) - option_names(command))
        return f"{command.name} has no option {', '.join(unknown)}" if unknown else None
    try:
        values, _, _ = command.make_parser(click.Context(command, info_name=command.name)) \
            .parse_args(args)
    except click.UsageError as error:
        return f"{command.name}: {error.format_message()}"
    for param in command.params:
        value = values.get(param.name)
        if isinstance(param.type, click.Choice) and isinstance(value, str) \
                and not value.isupper() and value not in param.type.choices:
            return f"{command.name}: {value!r} is not one of {param.type.choices} ({param.name})"
    return None


def test_every_documented_command_parses_against_the_command_line():
    from edgespec.cli import main

    problems = [f"{page.relative_to(REPO)}: {line}: {problem}"
                for page in DOCS
                for line, words in command_lines(page.read_text(encoding="utf-8"))
                if (problem := command_problem(main, words)) is not None]
    assert problems == []


def test_the_docs_show_commands_to_check():
    counts = {page.relative_to(REPO).as_posix(): len(command_lines(page.read_text(
        encoding="utf-8"))) for page in DOCS}
    assert counts["README.md"] >= 5 and sum(counts.values()) >= 30, counts


@pytest.mark.parametrize("markdown, problems", [
    ("```bash\nedgespec generate PKG \"def f():\" --seed 0 -n 8\n```\n", [None]),
    ("```bash\npip install -e . && edgespec generat PKG \"x\"\n```\n", ["no subcommand"]),
    ("```bash\nedgespec models build smollm2 --bogus\n```\n", ["No such option"]),
    ("```bash\nEDGESPEC_API_KEY=k edgespec serve pkg --port  # 8000\n```\n", ["requires an"]),
    ("```bash\nedgespec export --target T --out P --graph fast\n```\n", ["not one of"]),
    ("```\nedgespec bench [PKG_DIR] [--repeats R]\n               [--bogus]\n```\n",
     ["no option --bogus"]),
    ("```\n$ printf 'hi\\n' | edgespec chat PKG -n 8\n```\n", [None]),
    ("```python\nedgespec.load('edgespec x --bogus')\n```\n", []),
])
def test_the_command_check_flags_a_bogus_subcommand_or_option(markdown, problems):
    from edgespec.cli import main

    found = [command_problem(main, words) for _, words in command_lines(markdown)]
    assert len(found) == len(problems)
    for problem, expected in zip(found, problems):
        assert problem is None if expected is None else expected in (problem or ""), problem


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to -."""
    body = FENCE.sub("", markdown)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", body, re.M)}


def broken_links(page: Path, markdown: str) -> list[str]:
    """The relative links of a page (``[text](docs/serve.md#api-key)``, ``(#chat)``) whose file,
    or whose heading in it, does not exist; web addresses are not checked."""
    broken = []
    for target in LINK.findall(FENCE.sub("", markdown)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve()
        if path and not linked.exists():
            broken.append(target)
        elif anchor and (not path or linked.suffix == ".md") and anchor not in anchors(
                linked.read_text(encoding="utf-8") if path else markdown):
            broken.append(target)
    return broken


def test_every_relative_link_in_the_docs_leads_somewhere():
    broken = {page.relative_to(REPO).as_posix(): links for page in DOCS
              if (links := broken_links(page, page.read_text(encoding="utf-8")))}
    assert broken == {}


def test_the_link_check_flags_a_missing_file_or_heading():
    page = REPO / "docs" / "index-test.md"
    markdown = ("# Top\n## The `serve` API, briefly\n[a](serve.md) [b](../README.md) [c](#top) "
                "[d](#the-serve-api-briefly) [e](https://example.com/x.md) [f](nowhere.md) "
                "[g](serve.md#no-such-heading) [h](#gone)\n```\n[i](fenced.md)\n```\n")
    assert broken_links(page, markdown) == ["nowhere.md", "serve.md#no-such-heading", "#gone"]


def test_the_readme_gives_the_test_command_ci_runs():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = ci[next(i for i, line in enumerate(ci) if line.startswith("# README's test command"))
                 + 1].strip()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [block for lang, block in FENCE.findall(readme) if lang == "bash"]
    assert any(command in block.splitlines() for block in blocks), command
