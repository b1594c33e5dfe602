"""``edgespec distill`` on a target that is not ChatML: a tiny random Llama with a Llama-3-style
tokenizer (turns end with ``<|eot_id|>``, the tokenizer's EOS is ``<|end_of_text|>``, no pad,
both ends in generation_config.json). The head it trains exports and loads; a target that
names no end token, or has no chat template for chat prompts, is refused in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import _train_bpe, llama  # noqa: E402

import edgespec  # noqa: E402

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _llama3_target(folder, template: str | None = LLAMA3_TEMPLATE, ends: bool = True):
    """A tiny random Llama saved with a Llama-3-style tokenizer; ``ends``: its configs and
    tokenizer name end tokens (generation_config: [<|end_of_text|>, <|eot_id|>]), else none."""
    from transformers import PreTrainedTokenizerFast

    backend = _train_bpe(400)
    backend.add_special_tokens(LLAMA3_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>" if ends else None, chat_template=template)
    model = llama(len(tokenizer), 64, 3, seed=11, positions=2048)
    end_of_text, eot = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = None
    model.config.eos_token_id = end_of_text if ends else None
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = [end_of_text, eot] if ends else None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, eot


def _distill(target, out, *options):
    from click.testing import CliRunner

    from edgespec.cli import main

    return CliRunner().invoke(main, ["distill", "--target", str(target), "--out", str(out),
                                     *options])


def test_distill_trains_a_head_for_a_llama3_style_target_that_exports_and_loads(tmp_path):
    """The chat prompts rendered with the target's own template, its replies ended by its own
    end tokens (both in the draft vocabulary, as the exporter's EOS), a few optimizer steps;
    the head exports beside the target, and drafting with it keeps greedy output exact."""
    from edgespec.export import export_pair
    from edgespec.export.eagle3 import D2T
    from safetensors.torch import load_file

    target, eot = _llama3_target(tmp_path / "target")
    head = tmp_path / "head"
    result = _distill(target, head, "--prompts", "2", "1", "1", "--new-tokens", "8",
                      "--max-steps", "3", "--draft-vocab", "64", "--steps", "2")
    assert result.exit_code == 0, result.output
    report = json.loads((head / "training_report.json").read_text())
    assert report["steps"] == 3 and report["draft_vocab"] == 64
    d2t = load_file(head / "model.safetensors")[D2T]
    token_ids = (d2t + torch.arange(len(d2t))).tolist()
    assert eot in token_ids  # always kept: the head can propose the end of a turn
    records = [r for batch in torch.load(head / "work" / "teacher.pt") for r in batch]
    assert records and all(len(r["ids"]) - r["start"] <= 8 for r in records)

    export_pair(target, head, tmp_path / "package")
    pipe = edgespec.load(tmp_path / "package")
    prompt = "def add(a, b):"
    baseline = pipe.generate(prompt, max_new_tokens=12, drafter="none", ignore_eos=True)
    drafted = pipe.generate(prompt, max_new_tokens=12, draft_length=2, schedule="fixed",
                            ignore_eos=True)
    assert drafted.token_ids == baseline.token_ids and drafted.stats.drafted > 0


def test_the_teacher_ends_replies_at_any_of_the_targets_end_tokens(tmp_path):
    """end_tokens reads generation_config's list (Llama 3 names several) and the pad falls
    back to the first of them; ``answer`` asks generate to stop at all of them and cuts each
    reply after the first it writes, whichever it is (a target stub replies)."""
    from types import SimpleNamespace

    from edgespec.export.source import read_checkpoint
    from edgespec.models.training.teacher import answer, end_tokens, load_target

    target_path, eot = _llama3_target(tmp_path / "target")
    checkpoint = read_checkpoint(target_path, "target")
    end = end_tokens(checkpoint)
    assert set(end.stop) == {eot, checkpoint.tokenizer.eos_token_id} and end.pad == end.stop[0]
    _, tokenizer = load_target(target_path)
    replies = [[5, 6, eot, 7], [8, 9, 10, 11]]
    asked = {}

    def generate(ids, **kwargs):
        asked.update(kwargs)
        sequences = torch.cat([ids, torch.tensor(replies)], 1)
        return SimpleNamespace(sequences=sequences,
                               logits=tuple(torch.randn(2, len(tokenizer)) for _ in range(4)))

    prompts = [{"kind": "question", "messages": [{"role": "user", "content": text}]}
               for text in ("Hi", "Hello there")]
    records = answer(SimpleNamespace(generate=generate), tokenizer, prompts, 4, 3, 2, 0, end,
                     lambda line: None)
    assert sorted(asked["eos_token_id"]) == sorted(end.stop) and asked["pad_token_id"] == end.pad
    by_length = sorted(records, key=lambda r: r["start"])  # the stub answers in length order
    assert [r["ids"][r["start"]:] for r in by_length] == [[5, 6, eot], [8, 9, 10, 11]]
    assert [len(r["top_ids"]) for r in by_length] == [3, 4]


def test_distill_refuses_a_target_without_end_tokens_or_chat_template(tmp_path):
    """One line each, exit 1, no traceback, nothing made."""
    no_end, _ = _llama3_target(tmp_path / "no_end", ends=False)
    result = _distill(no_end, tmp_path / "h1")
    assert result.exit_code == 1 and "names no end-of-sequence token" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "h1").exists()
    no_template, _ = _llama3_target(tmp_path / "no_template", template=None)
    result = _distill(no_template, tmp_path / "h2")
    assert result.exit_code == 1 and "has no chat template" in result.output
    assert "--data code" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "h2").exists()


def test_distill_help_states_the_configs_defaults():
    """The options' defaults are DistillConfig's, not copies that drift from it."""
    from click.testing import CliRunner

    from edgespec.cli import main
    from edgespec.models.training.config import DistillConfig

    help_text = CliRunner().invoke(main, ["distill", "--help"]).output
    chunks = {chunk.split()[0]: " ".join(chunk.split())  # each option's own lines
              for chunk in re.split(r"\n\s+--", help_text)[1:]}
    config = DistillConfig()
    for option, value in (("minutes", config.minutes), ("draft-vocab", config.draft_vocab),
                          ("steps", config.steps), ("tokens", config.tokens),
                          ("new-tokens", config.new_tokens), ("seed", config.seed),
                          ("data", config.data),
                          ("prompts", ", ".join(map(str, config.prompts)))):
        shown = re.search(r"\[default: ([^];]*)", chunks[option])
        assert shown and shown[1] == str(value), (option, shown and shown[1])


def test_continuations_fewer_tokens_than_a_batch_still_make_one_batch():
    """``--data code --tokens 1000`` asks for fewer continuations than one generated batch:
    one whole batch is made (it was an 8-row store for 32 rows, a RuntimeError)."""
    from edgespec.models.training.teacher import target_continuations

    target = llama(50, 32, 1, seed=3)
    stream = torch.randint(0, 50, (200,))
    targets = target_continuations(target, stream, tokens=100, prompt_length=4, new_tokens=4,
                                   top_k=2, seed=0)
    assert targets.windows.shape == (32, 8) and targets.top_ids.shape == (32, 7, 2)


@pytest.mark.parametrize("case", ["out", "gguf"])
def test_distill_refuses_bad_arguments_before_torch_loads(tmp_path, case):
    """A folder that is not a head being distilled, or a file that is not GGUF, is one line
    and exit 1 before torch is imported (it takes seconds to load)."""
    target, out = tmp_path / "target", tmp_path / "out"
    target.mkdir()
    if case == "out":
        (out / "mine.txt").parent.mkdir()
        (out / "mine.txt").write_text("keep me")
    else:
        target = tmp_path / "target.gguf"
        target.write_bytes(b"not a gguf file")
    code = ("import sys; from edgespec.cli import main\n"
            "try:\n"
            f"    main(['distill', '--target', {str(target)!r}, '--out', {str(out)!r}])\n"
            "except SystemExit as e:\n"
            "    print('torch' in sys.modules, e.code)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split() == ["False", "1"], proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    if case == "out":
        assert (out / "mine.txt").read_text() == "keep me"


# -- refused before any work, and resume folders from strangers (issue 50) ------------------------

LOOPING = "{% for i in range(10**9) %}{{ i }}{% endfor %}"
ESCAPING = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


def _one_line(result, match: str) -> None:
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and match in errors[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("template", [LOOPING, ESCAPING], ids=["looping", "escaping"])
def test_a_hostile_chat_template_in_a_gguf_target_is_refused_leaving_no_folder(
        tmp_path, template):
    """The template renders one prompt in the bounded child before OUT is made (before: the
    refusal came from the teacher stage, after OUT/work was made, and left it behind)."""
    from gguf_files import write_gguf

    target = write_gguf(tmp_path / "t.gguf", "llama", {}, chat_template=template)
    out = tmp_path / "head"
    _one_line(_distill(target, out, "--prompts", "1", "1", "1"), "template")
    assert not out.exists()


def test_a_gguf_target_without_accelerate_is_refused_before_any_work(tmp_path):
    """accelerate made unimportable (transformers then sees it missing, as where it is not
    installed): one line naming it and its install command, nothing made (before: transformers'
    ValueError traceback from the model load, and OUT/work left behind)."""
    from gguf_files import write_gguf

    target = write_gguf(tmp_path / "t.gguf", "llama", {})
    out = tmp_path / "head"
    code = ("import sys; sys.modules['accelerate'] = None\n"
            "from edgespec.cli import main\n"
            f"main(['distill', '--target', {str(target)!r}, '--out', {str(out)!r}, "
            "'--data', 'code', '--tokens', '1000'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "accelerate" in proc.stderr and "pip install 'accelerate>=0.26'" in proc.stderr
    assert not out.exists()


class _Payload:
    """A pickle that would run a command when loaded: what a resume folder from a stranger may
    hold."""

    def __reduce__(self):
        import os

        return os.system, ("touch PWNED",)


def test_resume_files_that_are_not_the_stages_are_refused_and_kept(tmp_path, monkeypatch):
    """A finished distill's work files replaced one at a time by a pickle of code and by plain
    tensors of another layout: each second run refuses in one line naming the file, runs
    nothing, and leaves the file as it was (before: torch.load's UnpicklingError traceback for
    the pickle; a TypeError deep in the stage for the other layout)."""
    import pickle

    monkeypatch.chdir(tmp_path)
    target, _ = _llama3_target(tmp_path / "target")
    head = tmp_path / "head"
    options = ("--prompts", "2", "1", "1", "--new-tokens", "8", "--max-steps", "2",
               "--draft-vocab", "64", "--steps", "1")
    assert _distill(target, head, *options).exit_code == 0
    for name in ("teacher.pt", "features.pt", "state.pt"):
        file = head / "work" / name
        kept = file.read_bytes()
        for spoiled in (pickle.dumps(_Payload()), None):
            if spoiled is None:
                torch.save({"not": torch.zeros(2)} if name != "state.pt" else [1, 2], file)
            else:
                file.write_bytes(spoiled)
            before = file.read_bytes()
            _one_line(_distill(target, head, *options), str(file))
            assert file.read_bytes() == before and not (tmp_path / "PWNED").exists()
        file.write_bytes(kept)
    assert _distill(target, head, *options).exit_code == 0  # the kept files resume as before
