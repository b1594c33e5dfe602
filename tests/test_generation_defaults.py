"""Sampling defaults: the target's generation_config.json travels into the package and is used
where a request sets none; what the user sets wins."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

import edgespec
from edgespec.cli import main
from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.export import export_pair

PROMPT = "def add(a, b):"


def with_generation_config(checkpoints, tmp_path, **settings):
    """A copy of the tiny Llama target whose generation_config.json holds ``settings``."""
    folder = tmp_path / "target"
    shutil.copytree(checkpoints["llama_target"], folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **settings}))
    return folder


@pytest.fixture(scope="module")
def sampled_package(checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("defaults")
    target = with_generation_config(checkpoints, tmp, do_sample=True, temperature=0.7,
                                    top_k=20, top_p=0.9, repetition_penalty=1.1)
    lines = []
    export_pair(target, checkpoints["llama_noisy"], tmp / "pkg", validation="skip",
                progress=lines.append)
    return tmp / "pkg", lines


def test_the_checkpoints_sampling_settings_travel_into_the_manifest(sampled_package):
    package, lines = sampled_package
    manifest = edgespec.load(package).manifest
    assert manifest.generation == {"temperature": 0.7, "top_k": 20, "top_p": 0.9,
                                   "repetition_penalty": 1.1}
    assert not any("repetition_penalty" in line for line in lines if "not applied" in line)


def test_greedy_checkpoints_default_to_greedy_and_silent_ones_to_nothing(checkpoints, tmp_path):
    # do_sample false and temperature 1 are transformers' defaults: written, they are a choice
    target = with_generation_config(checkpoints, tmp_path, do_sample=False, temperature=1.0,
                                    repetition_penalty=1.3, typical_p=0.9)
    lines = []
    manifest = export_pair(target, checkpoints["llama_noisy"], tmp_path / "pkg",
                           validation="skip", progress=lines.append)
    assert manifest.generation == {"temperature": 0.0, "repetition_penalty": 1.3}  # greedy too
    assert any("not applied: typical_p 0.9" in line for line in lines)
    # a generation_config.json that sets no sampling field states no preference
    silent = export_pair(checkpoints["llama_target"], checkpoints["llama_noisy"],
                         tmp_path / "pkg2", validation="skip")
    assert silent.generation == {}


def test_requests_that_set_nothing_sample_with_the_packages_defaults(sampled_package):
    pipe = edgespec.load(sampled_package[0])
    assert pipe.default_sampling == SamplingConfig(0.7, 20, 0.9, repetition_penalty=1.1)
    defaults = pipe.generate(PROMPT, max_new_tokens=24, seed=5)
    explicit = pipe.generate(PROMPT, max_new_tokens=24, seed=5, temperature=0.7, top_k=20,
                             top_p=0.9)
    assert defaults.token_ids == explicit.token_ids
    # one setting given: the others still come from the package (transformers does the same)
    hotter = pipe.generate(PROMPT, max_new_tokens=24, seed=5, temperature=1.3)
    assert hotter.token_ids == pipe.generate(
        PROMPT, max_new_tokens=24, seed=5, temperature=1.3, top_k=20, top_p=0.9).token_ids
    # a whole GenerationConfig is taken as it is: its sampling is greedy
    greedy = pipe.generate(PROMPT, GenerationConfig(max_new_tokens=24))
    assert greedy.token_ids == pipe.generate(PROMPT, max_new_tokens=24, temperature=0,
                                             repetition_penalty=1.0).token_ids


def test_the_command_line_uses_the_defaults_unless_told(sampled_package):
    package = str(sampled_package[0])
    pipe = edgespec.load(package)

    def ids(*options):
        result = CliRunner().invoke(main, ["generate", package, PROMPT, "-n", "16", "--seed", "3",
                                           "--json", *options])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["token_ids"]

    assert ids() == pipe.generate(PROMPT, max_new_tokens=16, seed=3).token_ids
    assert ids("-t", "0") == pipe.generate(PROMPT, max_new_tokens=16, temperature=0).token_ids
    refused = CliRunner().invoke(main, ["generate", package, PROMPT, "--top-p", "0"])
    assert refused.exit_code == 1 and "top_p must be" in refused.output


def test_the_server_fills_omitted_settings_from_the_package_then_greedy_as_the_cli_does():
    from types import SimpleNamespace

    from edgespec.serve.app import _sampling
    from edgespec.serve.schemas import CompletionRequest

    def server(generation):
        return SimpleNamespace(pipe=SimpleNamespace(manifest=SimpleNamespace(generation=generation)))

    body = CompletionRequest(model="m", prompt="x", top_p=0.5)
    unset = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
             "frequency_penalty": 0.0}
    assert _sampling(server({}), body) == {"temperature": 0.0, "top_k": 0, "top_p": 0.5,
                                           **unset}
    assert _sampling(server({"temperature": 0.7, "top_k": 20, "top_p": 0.9}), body) == {
        "temperature": 0.7, "top_k": 20, "top_p": 0.5, **unset}
