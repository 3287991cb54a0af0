"""``fasttree.validation``: the shared argument checks (bools, numpy scalars, bounds, NaN, messages)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest

from fasttree.validation import (
    check_choice,
    check_int,
    check_int_array,
    check_int_pair,
    check_nonempty_str,
    check_number,
    is_int,
    is_number,
)

# ------------------------------------------------------------------ predicates


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int8(1), np.int64(-5), np.uint64(2**63)])
def test_is_int_accepts_python_and_numpy_integers(value):
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float64(2), "1", None, [1], Fraction(1)])
def test_is_int_refuses_bools_floats_and_others(value):
    assert not is_int(value)


def test_is_number_and_finiteness():
    assert is_number(1) and is_number(np.float32(0.5)) and is_number(Fraction(1, 3)) and is_number(math.inf)
    assert not is_number(True) and not is_number(np.bool_(False)) and not is_number("1.0") and not is_number(None)
    assert is_number(math.nan) and not is_number(math.nan, finite=True)
    assert not is_number(-math.inf, finite=True) and is_number(np.float64(3.5), finite=True)


# ------------------------------------------------------------------ check_int


def test_check_int_returns_a_python_int():
    out = check_int("n", np.int64(7), minimum=0)
    assert out == 7 and type(out) is int
    assert type(check_int("n", np.uint8(3))) is int
    assert check_int("n", -(2**70)) == -(2**70)  # no bound: anything integral


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, 2.5, "1", None, np.float64(1)])
def test_check_int_refuses_bools_and_non_integers_naming_the_value(value):
    with pytest.raises(ValueError, match=re.escape(f"step must be an integer, got {value!r}")):
        check_int("step", value, minimum=0)


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"minimum": 1}, 0, "every must be >= 1, got 0"),
        ({"minimum": 0}, -1, "every must be >= 0, got -1"),
        ({"maximum": 8}, 9, "every must be <= 8, got 9"),
        ({"minimum": 1, "maximum": 256}, 257, "every must be in [1, 256], got 257"),
        ({"minimum": 1, "maximum": 256}, np.int32(0), "every must be in [1, 256], got 0"),
    ],
)
def test_check_int_bounds(kwargs, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_int("every", value, **kwargs)


def test_check_int_bounds_are_inclusive():
    assert check_int("g", 1, minimum=1, maximum=256) == 1
    assert check_int("g", 256, minimum=1, maximum=256) == 256


@pytest.mark.parametrize("value", [0, -4, 1.5, True])
def test_check_int_expected_words_replace_both_messages(value):
    with pytest.raises(ValueError, match=re.escape(f"n_seeds must be a positive integer, got {value!r}")):
        check_int("n_seeds", value, minimum=1, expected="a positive integer")


# ------------------------------------------------------------------ check_number


def test_check_number_returns_a_float():
    for value in (3, np.int64(3), np.float32(3.0), Fraction(3)):
        out = check_number("x", value)
        assert out == 3.0 and type(out) is float


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float64("nan")])
def test_check_number_refuses_non_finite_values(value):
    with pytest.raises(ValueError, match=re.escape(f"alpha must be a finite number, got {value!r}")):
        check_number("alpha", value)


@pytest.mark.parametrize("value", [True, False, "0.5", None, [1.0], np.array([1.0])])
def test_check_number_refuses_bools_and_non_numbers(value):
    with pytest.raises(ValueError, match=re.escape(f"alpha must be a finite number, got {value!r}")):
        check_number("alpha", value)


def test_check_number_infinity_passes_only_without_finite():
    assert check_number("budget_s", math.inf, above=0, finite=False) == math.inf
    with pytest.raises(ValueError, match="budget_s must be a number, got 'x'"):
        check_number("budget_s", "x", above=0, finite=False)
    with pytest.raises(ValueError, match="budget_s must be > 0, got nan"):  # NaN meets no bound
        check_number("budget_s", math.nan, above=0, finite=False)
    with pytest.raises(ValueError, match="budget_s must be > 0, got -inf"):
        check_number("budget_s", -math.inf, above=0, finite=False)


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"above": 0}, 0, "x must be > 0, got 0"),  # an integer is shown as given
        ({"above": 0}, -0.5, "x must be > 0, got -0.5"),
        ({"minimum": 0}, np.float64(-1.0), "x must be >= 0, got -1.0"),
        ({"maximum": 1}, 1.25, "x must be <= 1, got 1.25"),
        ({"below": 1}, 1, "x must be < 1, got 1"),
        ({"minimum": 0, "below": 1}, 1.0, "x must be in [0, 1), got 1.0"),
        ({"above": 0, "maximum": 1}, 0.0, "x must be in (0, 1], got 0.0"),
        ({"above": 0, "below": 1}, 1, "x must be in (0, 1), got 1"),
        ({"minimum": 0, "maximum": 1}, -1, "x must be in [0, 1], got -1"),
    ],
)
def test_check_number_bounds(kwargs, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_number("x", value, **kwargs)


def test_check_number_bounds_include_their_edges_only_when_inclusive():
    assert check_number("x", 0, minimum=0, maximum=1) == 0.0
    assert check_number("x", 1, minimum=0, maximum=1) == 1.0
    assert check_number("x", 0.5, above=0, below=1) == 0.5


def test_check_number_expected_words_and_bound_conflicts():
    with pytest.raises(ValueError, match=re.escape("c_iter_us must be a positive finite number, got -1.0")):
        check_number("c_iter_us", -1.0, above=0, expected="a positive finite number")
    with pytest.raises(ValueError, match="c_iter_us must be a positive finite number, got nan"):
        check_number("c_iter_us", math.nan, above=0, expected="a positive finite number")
    with pytest.raises(TypeError):
        check_number("x", 1.0, minimum=0, above=0)
    with pytest.raises(TypeError):
        check_number("x", 1.0, maximum=2, below=2)


# ------------------------------------------------------------------ check_choice


def test_check_choice_returns_the_value():
    assert check_choice("split", "train", ("train", "heldout")) == "train"
    assert check_choice("kind", "gbrt", {"gbrt": 1, "forest": 2}) == "gbrt"  # a dict's keys
    assert check_choice("n", np.int64(2), (1, 2)) == 2
    assert check_choice("n", 2, (x for x in (1, 2))) == 2  # a one-shot iterable


def test_check_choice_refuses_a_bool_unless_a_bool_is_a_choice():
    with pytest.raises(ValueError, match=re.escape("stage1_launches must be one of [1, 2], got True")):
        check_choice("stage1_launches", True, (1, 2))
    with pytest.raises(ValueError, match="got False"):
        check_choice("pdl", False, (0, 1))
    assert check_choice("flag", True, (True, "auto")) is True


@pytest.mark.parametrize("value", ["float32", None, [1], {"a": 1}, np.array([1, 2])])
def test_check_choice_refuses_other_values_listing_the_choices(value):
    with pytest.raises(ValueError, match=re.escape(f"dtype must be one of ['float16', 'bfloat16'], got {value!r}")):
        check_choice("dtype", value, ("float16", "bfloat16"))
    with pytest.raises(ValueError, match=re.escape(f"dtype must be one of ['float16'], got {value!r}")):
        check_choice("dtype", value, {"float16"})  # an unhashable value among hashed choices


def test_check_choice_expected_words():
    with pytest.raises(ValueError, match=re.escape("case must be one of 1..15, got 0")):
        check_choice("case", 0, range(1, 16), expected="one of 1..15")


# ------------------------------------------------------------------ strings and pairs


def test_check_nonempty_str():
    assert check_nonempty_str("family", "recorded") == "recorded"
    for value in ("", None, 3, b"x"):
        with pytest.raises(ValueError, match=re.escape(f"family must be a non-empty string, got {value!r}")):
            check_nonempty_str("family", value)


def test_check_int_pair():
    assert check_int_pair("kv_tile", [np.int64(64), 16]) == (64, 16)
    assert check_int_pair("tokens", (3, 3), minimum=1, ordered=True) == (3, 3)
    assert check_int_pair("kv_tile", (64, 128)) == (64, 128)  # unordered: any order
    with pytest.raises(ValueError, match=re.escape("kv_tile must be a pair of integers, got 5")):
        check_int_pair("kv_tile", 5)
    with pytest.raises(ValueError, match=re.escape("tokens must be a (min, max) pair of integers, got (1, 2, 3)")):
        check_int_pair("tokens", (1, 2, 3), ordered=True)
    with pytest.raises(ValueError, match=re.escape("tokens[1] must be an integer, got True")):
        check_int_pair("tokens", (1, True))
    with pytest.raises(ValueError, match=re.escape("tokens[0] must be >= 1, got 0")):
        check_int_pair("tokens", (0, 4), minimum=1)
    with pytest.raises(ValueError, match=re.escape("tokens = (9, 4): min exceeds max")):
        check_int_pair("tokens", (9, 4), ordered=True)


# ------------------------------------------------------------------ integer arrays


def test_check_int_array_converts_to_int64():
    out = check_int_array("parents", [-1, 0, 0])
    assert out.dtype == np.int64 and out.tolist() == [-1, 0, 0]
    small = np.arange(4, dtype=np.int32)
    assert check_int_array("slots", small, keep_dtype=True) is small
    assert check_int_array("slots", small).dtype == np.int64
    assert check_int_array("big", np.array([2**62], dtype=np.uint64), keep_dtype=True).dtype == np.int64
    empty = check_int_array("lengths", np.zeros((0, 3), dtype=np.float32), ndim=2)
    assert empty.shape == (0, 3) and empty.dtype == np.int64


@pytest.mark.parametrize(
    ("value", "ndim", "message"),
    [
        ([[1, 2]], 1, "parents must be a 1-D integer array, got shape (1, 2)"),
        (3, 1, "parents must be a 1-D integer array, got shape ()"),
        ([1, 2], 2, "parents must be a 2-D integer array, got shape (2,)"),
        ([1.0, 2.0], 1, "parents must hold integers, got dtype float64"),
        ([True, False], 1, "parents must hold integers, got dtype bool"),
        (np.array([2**64 - 1], dtype=np.uint64), 1, f"parents holds {2**64 - 1}, beyond the int64 range"),
    ],
)
def test_check_int_array_refuses_bad_arrays(value, ndim, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_int_array("parents", value, ndim=ndim)
