"""Settings: every bad one is a ConfigError (an EdgespecError and a ValueError) naming the field."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.errors import EdgespecError
from edgespec.runtime.pipeline import make_config

BAD_GENERATION = [
    dict(max_new_tokens="5"), dict(max_new_tokens=0), dict(max_new_tokens=2.5),
    dict(draft_length=0), dict(draft_length=65), dict(draft_length=True),
    dict(seed=-1), dict(seed="1"), dict(seed=1.5),
    dict(schedule="magic"), dict(schedule=None),
    dict(stop=("",)), dict(stop=("END", 5)), dict(stop="END"),
    dict(ignore_eos=1), dict(token_healing="yes"), dict(token_healing=None),
    dict(sampling={"temperature": 1.0}),
]
BAD_SAMPLING = [
    dict(temperature="0.5"), dict(temperature=-1), dict(temperature=True),
    dict(top_k=1.5), dict(top_k=-1), dict(top_k="3"), dict(top_p="1"), dict(top_p=0.0),
    dict(min_p=-0.1), dict(min_p=1.5), dict(min_p="0.1"),
]


def refused(make, settings):
    with pytest.raises(EdgespecError) as error:
        make(**settings)
    assert isinstance(error.value, ValueError)  # callers that caught ValueError still do
    assert next(iter(settings)) in str(error.value)


@pytest.mark.parametrize("settings", BAD_GENERATION, ids=repr)
def test_bad_generation_settings_are_config_errors(settings):
    refused(GenerationConfig, settings)


@pytest.mark.parametrize("settings", BAD_SAMPLING, ids=repr)
def test_bad_sampling_settings_are_config_errors(settings):
    refused(SamplingConfig, settings)


@pytest.mark.parametrize("settings", [*BAD_GENERATION, *BAD_SAMPLING, dict(stop=5)], ids=repr)
def test_make_config_refuses_the_same_settings(settings):
    if settings == dict(stop="END"):
        assert make_config(**settings).stop == ("END",)  # one stop string, made a tuple
        return
    refused(make_config, settings)


def test_draft_length_out_of_range_names_the_allowed_range():
    with pytest.raises(EdgespecError, match=r"draft_length must be an integer in 1\.\.64"):
        GenerationConfig(draft_length=100_000)


def test_the_former_names_are_gone():
    """gamma and use_draft had no release behind them: draft_length and drafter="none"."""
    with pytest.raises(TypeError):
        GenerationConfig(gamma=3)
    with pytest.raises(EdgespecError, match="unknown generation setting.*gamma"):
        make_config(gamma=2)
    assert not hasattr(GenerationConfig(), "use_draft")


def test_unknown_settings_and_a_wrong_base_are_config_errors():
    with pytest.raises(EdgespecError, match="unknown generation setting.*colour"):
        make_config(colour="blue")
    with pytest.raises(EdgespecError, match="config must be a GenerationConfig"):
        make_config({"gamma": 2})


def test_good_settings_of_other_numeric_types_pass():
    config = GenerationConfig(max_new_tokens=np.int64(8), draft_length=np.int32(64), seed=0,
                              sampling=SamplingConfig(temperature=1, top_k=np.int64(5),
                                                      top_p=np.float32(0.5)))
    assert config.draft_length == 64 and config.sampling.temperature == 1
    assert make_config(stop=["a", "b"]).stop == ("a", "b")
    assert make_config(seed=2**40).seed == 2**40


@pytest.mark.parametrize("settings", [dict(provider="gpu"), dict(threads=-1)], ids=repr)
def test_bad_session_settings_are_config_errors(settings):
    from edgespec.runtime.providers import SessionConfig

    refused(SessionConfig, settings)
