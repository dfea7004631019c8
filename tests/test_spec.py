"""Presets in data/models.yaml: parameter counts within 0.5 % of the sizes their sources publish."""

from __future__ import annotations

import pytest

from labkit.theory.spec import get_spec, presets

REQUIRED = ("llama-3-8b", "llama-3-70b", "llama-3.1-405b", "llama-2-7b", "llama-2-13b", "llama-2-70b",
            "mixtral-8x7b", "gpt-3-175b", "lab-tiny-llama", "lab-tiny-gpt", "lab-small-llama")
PUBLISHED = sorted(n for n, s in presets().items() if s.published_params)


def test_required_presets_exist():
    missing = set(REQUIRED) - set(presets())
    assert not missing, f"presets missing from data/models.yaml: {sorted(missing)}"


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_count_within_half_a_percent_of_published(name):
    spec = get_spec(name)
    rel = spec.n_params() / spec.published_params - 1
    assert abs(rel) <= 0.005, (f"{name}: n_params()={spec.n_params():,} vs published "
                               f"{spec.published_params:,.0f} ({rel:+.3%})")


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_presets_name_their_source(name):
    spec = get_spec(name)
    assert spec.source.startswith("https://") or "et al." in spec.source or "Team" in spec.source, spec.source


def test_mixtral_active_parameters_match_published():
    spec = get_spec("mixtral-8x7b")
    published = spec.extra["published_active_params"]
    assert abs(spec.n_active_params() / published - 1) <= 0.005
    assert spec.n_moe_layers == 32 and spec.n_active_params() < spec.n_params() / 3


def test_published_sizes_are_the_papers_not_the_formula():
    # guard against "fixing" a preset by copying n_params() into published_params: the stated sizes are round
    for name in PUBLISHED:
        p = get_spec(name).published_params
        assert float(f"{p:.3g}") == p, f"{name}: published_params={p} has more digits than any source states"


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'llama-9'.*valid presets: .*llama-3-70b"):
        get_spec("llama-9")
