"""Loading and prompting a package: a tokenizer that does not fit is refused, prompts are text."""

from __future__ import annotations

import json
import shutil

import pytest

import edgespec
from edgespec.errors import GenerationError, ManifestError
from edgespec.manifest import MANIFEST_NAME, TOKENIZER_NAME
from edgespec.models import demo_package


def copy_package(packages, tmp_path, name="gpt2"):
    pkg = tmp_path / "pkg"
    shutil.copytree(packages[name], pkg)
    return pkg


def test_a_corrupt_tokenizer_is_a_manifest_error(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    (pkg / TOKENIZER_NAME).write_text('{"version": "1.0", "model": ')
    with pytest.raises(ManifestError, match="cannot read .*tokenizer.json.*re-export the pair"):
        edgespec.load(pkg)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(packages, tmp_path):
    pkg = copy_package(packages, tmp_path)
    shutil.copy(demo_package() / TOKENIZER_NAME, pkg / TOKENIZER_NAME)  # 4096
    with pytest.raises(ManifestError, match="4096 tokens.*re-export the pair"):
        edgespec.load(pkg)


@pytest.mark.parametrize("field", ["eos_token_ids", "bos_token_id", "pad_token_id"])
def test_a_special_id_the_tokenizer_lacks_is_refused(packages, tmp_path, field):
    pkg = copy_package(packages, tmp_path)
    shutil.copy(packages["words"] / TOKENIZER_NAME, pkg / TOKENIZER_NAME)  # 8 tokens
    manifest = json.loads((pkg / MANIFEST_NAME).read_text())
    assert manifest["vocab_size"] > 50
    manifest[field] = [50] if field == "eos_token_ids" else 50
    (pkg / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=f"{field} 50 is not a token of .*re-export the pair"):
        edgespec.load(pkg)


@pytest.fixture(scope="module")
def pipe(packages):
    return edgespec.load(packages["gpt2"])


@pytest.mark.parametrize("prompt", ["\udcff", "ok \udcc3 then", "\ud83d"], ids=repr)
def test_a_prompt_that_is_not_utf8_is_a_generation_error(pipe, prompt):
    with pytest.raises(GenerationError, match="not valid UTF-8") as error:
        pipe.generate(prompt, max_new_tokens=2)
    assert "\\ud" in str(error.value)  # the culprit shown escaped, so the message prints


@pytest.mark.parametrize("prompt", [b"hi", None, ["hi"], 5], ids=repr)
def test_a_prompt_that_is_not_a_str_is_a_generation_error(pipe, prompt):
    with pytest.raises(GenerationError, match="the prompt must be a str"):  # or token ids
        pipe.generate(prompt, max_new_tokens=2)
