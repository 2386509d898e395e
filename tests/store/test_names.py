"""Adapter names are untrusted: nothing accepted may leave its prefix."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from lora_common.names import InvalidName, check_name, normalize_prefix, object_key, split_key


@pytest.mark.parametrize("name", ["support-bot", "a", "Llama3.2_sql-v2", "x" * 128, "0day"])
def test_good_names(name: str) -> None:
    assert check_name(name) == name
    assert split_key("adapters/", object_key("adapters/", name, "adapter_config.json")) == (name, "adapter_config.json")


@pytest.mark.parametrize("name", ["", "..", "../etc", "a/../../b", "a/b", "/abs", "\\win", "a\x00b", "tab\tname",
                                  "new\nline", "x" * 129, ".hidden", "-flag", "~root", "a..b", "名前", "a b",
                                  "del\x7f"])
def test_bad_names(name: str) -> None:
    with pytest.raises(InvalidName):
        check_name(name)
    with pytest.raises(InvalidName):
        object_key("adapters/", name, "adapter_config.json")


def test_keys_outside_the_layout_are_not_adapters() -> None:
    assert split_key("adapters/", "adapters/a/b/adapter_config.json") is None
    assert split_key("adapters/", "other/a/adapter_config.json") is None
    assert split_key("adapters/", "adapters/../x/adapter_config.json") is None
    assert split_key("adapters/", "adapters/a/") is None
    assert split_key("", "a/adapter_model.safetensors") == ("a", "adapter_model.safetensors")


def test_prefix_normalization() -> None:
    assert normalize_prefix("adapters") == "adapters/"
    assert normalize_prefix("/team/adapters/") == "team/adapters/"
    assert normalize_prefix("") == ""
    with pytest.raises(InvalidName):
        normalize_prefix("team/../other/")


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=140))
def test_accepted_names_stay_inside_their_prefix(name: str) -> None:
    try:
        check_name(name)
    except InvalidName:
        return
    key = object_key("adapters/", name, "adapter_model.safetensors")
    parts = key.split("/")
    assert parts[0] == "adapters" and len(parts) == 3 and parts[1] == name
    assert ".." not in parts and all(c.isprintable() for c in name) and len(name) <= 128
