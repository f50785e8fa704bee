"""The method registry (`qnpu_jax.pipeline.methods`): one spec per method, every table about
the methods derived from it, and the recipe table checked against it. No model is loaded."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from qnpu_jax.pipeline import config as C
from qnpu_jax.pipeline import methods as M
from qnpu_jax.pipeline import recipes
from qnpu_jax.report import table
from qnpu_jax.studies import compare_methods


def test_every_spec_has_a_recipe_and_every_recipe_a_spec():
    assert list(recipes.RECIPES) == list(M.METHODS)
    for name, recipe in recipes.RECIPES.items():
        assert recipe.__name__ == name == M.METHODS[name].name
    M.check_recipes(recipes.RECIPES)


def test_the_method_literal_is_the_spec_table():
    assert typing.get_args(M.Method) == tuple(M.METHODS) == M.METHOD_NAMES == C.METHODS
    assert C.CHOICES["method"] == M.METHOD_NAMES


def test_the_derived_tables_say_what_the_specs_say():
    specs = M.METHODS.values()
    assert tuple(s.name for s in specs if s.rotates) == M.ROTATING_METHODS
    assert tuple(s.name for s in specs if s.has_stage1) == M.STAGE1_METHODS
    assert tuple(s.name for s in specs if s.learns_scales) == M.SCALE_LEARNING_METHODS
    assert C.ROTATING_METHODS == M.ROTATING_METHODS
    assert C.SCALE_LEARNING_METHODS == M.SCALE_LEARNING_METHODS
    assert compare_methods.STAGE1_METHODS == M.STAGE1_METHODS
    assert dict(table.METHOD_LABELS) == {s.name: s.label for s in specs}
    # the values the tables had before they were derived
    assert M.ROTATING_METHODS == ("quarot", "spinquant", "quantnpu")
    assert M.SCALE_LEARNING_METHODS == ("quantnpu", "mobilequant")
    assert M.STAGE1_METHODS == ("spinquant", "quantnpu", "mobilequant")
    assert set(M.SCALE_LEARNING_METHODS) <= set(M.STAGE1_METHODS)


@pytest.mark.parametrize("method", M.METHOD_NAMES)
def test_a_config_takes_its_methods_option_defaults(method):
    spec = M.METHODS[method]
    assert set(M.METHOD_OFF) == {f.name for f in dataclasses.fields(C.MobileQuantOptions)}
    assert dataclasses.asdict(C.QuantizeConfig.of(method=method).mobilequant) == spec.defaults
    assert table.run_label(method, C.QuantizeConfig.of(method=method)) == spec.label


def test_the_option_defaults():
    assert M.MOBILEQUANT.defaults == {
        "equalize": 0.5,
        "weight_clipping": True,
        "asymmetric_activations": True,
        "asymmetric_weights": True,
        "selective": False,
    }
    for spec in (M.RTN, M.QUAROT, M.SPINQUANT, M.QUANTNPU):
        assert spec.defaults == dict(M.METHOD_OFF)


def test_every_method_has_a_shipped_config():
    shipped = {C.read_config_data(name)[1].get("method") for name in C.shipped_configs()}
    assert set(M.METHODS) <= shipped


def test_check_recipes_names_what_is_missing_and_what_is_extra():
    table_ = dict(recipes.RECIPES)
    del table_["quarot"]
    with pytest.raises(ValueError, match=r"^recipes.RECIPES: methods without a recipe: quarot$"):
        M.check_recipes(table_)
    extra = {**recipes.RECIPES, "omniquant": recipes.rtn}
    with pytest.raises(ValueError, match=r"^who: names without a method spec .*: 'omniquant'$"):
        M.check_recipes(extra, "who")
    del extra["rtn"]
    with pytest.raises(ValueError, match=r"without a recipe: rtn; names without a method spec"):
        M.check_recipes(extra, "who")


def test_a_spec_refuses_what_cannot_hold():
    with pytest.raises(ValueError, match=r"method rtn: unknown option\(s\) \['clip'\]"):
        M.MethodSpec(name="rtn", label="RTN", options={"clip": True})
    with pytest.raises(ValueError, match=r"method rtn: learns_scales needs has_stage1"):
        M.MethodSpec(name="rtn", label="RTN", learns_scales=True)
    with pytest.raises(ValueError, match=r"method rtn: unknown weight_init 'best'"):
        M.MethodSpec(name="rtn", label="RTN", weight_init="best")
    with pytest.raises(dataclasses.FrozenInstanceError):
        M.RTN.label = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        M.MOBILEQUANT.options["equalize"] = 0.1  # type: ignore[index]


def test_method_spec_names_the_known_methods():
    assert M.method_spec("quarot") is M.QUAROT
    with pytest.raises(C.QnpuError, match=r"unknown method 'nope'; known: rtn, quarot, "):
        M.method_spec("nope")
