"""Argument checks shared by the package: integers, numbers, choices, strings, pairs and integer arrays.

Each ``check_*`` function returns the value in a plain type (``int``, ``float``, an int64
array, ...) or raises ``ValueError`` with a message that names the argument and the
value it got, such as ``"every must be >= 1, got 0"`` or ``"step must be an integer,
got 1.5"``. A caller whose messages read differently (``"n_seeds must be a positive
integer, got 0"``) passes ``expected``, the accepted values in words; every failure then
reads ``"{name} must be {expected}, got {value!r}"``.

Rules common to all of them:

* ``bool`` is neither an integer nor a number here (``True`` is not a count), nor a
  choice unless the choices hold a ``bool``;
* numpy scalars are accepted (``np.int64(3)`` is an integer, ``np.float32(0.5)`` a
  number) and returned as Python ``int`` / ``float``;
* numbers must be finite unless ``finite=False``.

The ``is_*`` predicates answer the same questions without raising, for code that collects
problems (the trace validator) or falls back to a default.

Standard library and numpy only: the serving path imports this module.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Container, Iterable
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "check_choice",
    "check_int",
    "check_int_array",
    "check_int_pair",
    "check_nonempty_str",
    "check_number",
    "is_int",
    "is_number",
]

T = TypeVar("T")

_INT64_MAX = int(np.iinfo(np.int64).max)


# ------------------------------------------------------------------ predicates
def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer: a Python or numpy integer, not a ``bool``.

    Parameters
    ----------
    value : object

    Returns
    -------
    bool
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any, *, finite: bool = False) -> bool:
    """Whether ``value`` is a real number (Python or numpy integer or float, not a ``bool``).

    Parameters
    ----------
    value : object
    finite : bool
        Also require it to be finite (no NaN, no infinity).

    Returns
    -------
    bool
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


# ------------------------------------------------------------------ bounds
def _bound_words(minimum: Any = None, maximum: Any = None, above: Any = None, below: Any = None) -> str:
    """The bounds in words: ``">= 1"``, ``"> 0"``, ``"<= 8"``, ``"in [0, 1)"``."""
    lo = (">=", "[", minimum) if minimum is not None else (">", "(", above) if above is not None else None
    hi = ("<=", "]", maximum) if maximum is not None else ("<", ")", below) if below is not None else None
    if lo is not None and hi is not None:
        return f"in {lo[1]}{lo[2]}, {hi[2]}{hi[1]}"
    op, _, bound = lo if lo is not None else hi
    return f"{op} {bound}"


def _within(value: Any, minimum: Any, maximum: Any, above: Any = None, below: Any = None) -> bool:
    return (
        (minimum is None or value >= minimum)
        and (maximum is None or value <= maximum)
        and (above is None or value > above)
        and (below is None or value < below)
    )


def _one_lower_one_upper(minimum: Any, maximum: Any, above: Any, below: Any) -> None:
    if minimum is not None and above is not None:
        raise TypeError("give at most one of minimum and above")
    if maximum is not None and below is not None:
        raise TypeError("give at most one of maximum and below")


# ------------------------------------------------------------------ scalars
def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    expected: str | None = None,
) -> int:
    """``value`` as an ``int`` within ``[minimum, maximum]``, else ``ValueError``.

    Parameters
    ----------
    name : str
        What the value is, as the message names it (``"max_batch"``, ``"ks entry"``).
    value : object
        A Python or numpy integer; ``bool`` is refused.
    minimum, maximum : int, optional
        Inclusive bounds (None: unbounded).
    expected : str, optional
        The accepted values in words (``"a positive integer"``) for every failure's
        message; by default the message says ``"an integer"`` or the bound broken.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        ``"{name} must be an integer, got {value!r}"`` for a value that is not one,
        ``"{name} must be >= {minimum}, got {value}"`` (or ``<= maximum``, ``in [minimum,
        maximum]``) for one out of bounds.

    Examples
    --------
    >>> check_int("every", np.int64(4), minimum=1)
    4
    >>> check_int("every", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: every must be >= 1, got 0
    """
    if not is_int(value):
        raise ValueError(f"{name} must be {expected or 'an integer'}, got {value!r}")
    value = int(value)
    if not _within(value, minimum, maximum):
        raise ValueError(f"{name} must be {expected or _bound_words(minimum, maximum)}, got {value!r}")
    return value


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    finite: bool = True,
    expected: str | None = None,
) -> float:
    """``value`` as a ``float`` within its bounds, else ``ValueError``.

    Parameters
    ----------
    name : str
        What the value is, as the message names it.
    value : object
        A Python or numpy real number (integers included); ``bool`` is refused.
    minimum, maximum : float, optional
        Inclusive bounds.
    above, below : float, optional
        Exclusive bounds (``above=0``: positive); at most one lower and one upper bound.
    finite : bool
        Refuse NaN and infinities (default). With ``finite=False`` an infinity within the
        bounds passes; NaN never satisfies a bound.
    expected : str, optional
        The accepted values in words (``"a positive finite number"``) for every failure's
        message.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        ``"{name} must be a finite number, got {value!r}"`` (``"a number"`` with
        ``finite=False``) for a value that is not one, ``"{name} must be > 0, got
        -1.0"`` (``>=``, ``<=``, ``<``, ``in [0, 1)``, ...) for one out of bounds.
    TypeError
        When both ``minimum`` and ``above`` (or ``maximum`` and ``below``) are given.

    Examples
    --------
    >>> check_number("min_gain", 0.25, minimum=0, below=1)
    0.25
    >>> check_number("min_gain", 1.5, minimum=0, below=1)
    Traceback (most recent call last):
    ...
    ValueError: min_gain must be in [0, 1), got 1.5
    """
    _one_lower_one_upper(minimum, maximum, above, below)
    if not is_number(value, finite=finite):
        kind = "a finite number" if finite else "a number"
        raise ValueError(f"{name} must be {expected or kind}, got {value!r}")
    number = int(value) if isinstance(value, numbers.Integral) else float(value)
    if not _within(number, minimum, maximum, above, below):
        raise ValueError(f"{name} must be {expected or _bound_words(minimum, maximum, above, below)}, got {number!r}")
    return float(number)


def check_choice(name: str, value: T, choices: Iterable[Any], *, expected: str | None = None) -> T:
    """``value`` when it is one of ``choices``, else ``ValueError``.

    Membership is ``value in choices``, except that a ``bool`` is only a choice when the
    choices hold a ``bool`` (``True == 1`` would otherwise pass for the choice ``1``).

    Parameters
    ----------
    name : str
        What the value is, as the message names it.
    value : object
    choices : iterable
        The accepted values (a tuple, a set, a dict's keys, ...).
    expected : str, optional
        The accepted values in words for the message (default ``"one of [...]"``).

    Returns
    -------
    object
        ``value`` itself.

    Raises
    ------
    ValueError
        ``"{name} must be one of {list(choices)}, got {value!r}"``.

    Examples
    --------
    >>> check_choice("split", "heldout", ("train", "heldout"))
    'heldout'
    >>> check_choice("stage1_launches", True, (1, 2))
    Traceback (most recent call last):
    ...
    ValueError: stage1_launches must be one of [1, 2], got True
    """
    if not isinstance(choices, Container) or not isinstance(choices, Iterable):
        choices = tuple(choices)
    try:
        found = bool(value in choices)
    except (TypeError, ValueError):  # an unhashable value among hashed choices, an array
        found = False
    if found and isinstance(value, (bool, np.bool_)):
        found = any(isinstance(c, (bool, np.bool_)) for c in choices)
    if not found:
        raise ValueError(f"{name} must be {expected or f'one of {list(choices)}'}, got {value!r}")
    return value


def check_nonempty_str(name: str, value: Any, *, expected: str | None = None) -> str:
    """``value`` when it is a non-empty ``str``, else ``ValueError``.

    Parameters
    ----------
    name : str
        What the value is, as the message names it.
    value : object
    expected : str, optional
        The accepted values in words for the message (default ``"a non-empty string"``).

    Returns
    -------
    str

    Raises
    ------
    ValueError
        ``"{name} must be a non-empty string, got {value!r}"``.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be {expected or 'a non-empty string'}, got {value!r}")
    return value


# ------------------------------------------------------------------ collections
def check_int_pair(name: str, value: Any, *, minimum: int | None = None, ordered: bool = False) -> tuple[int, int]:
    """``value`` as a pair of ``int`` (each ``>= minimum``), else ``ValueError``.

    Parameters
    ----------
    name : str
        What the pair is; an entry is named ``f"{name}[0]"`` / ``f"{name}[1]"``.
    value : iterable
        Two integers.
    minimum : int, optional
        Inclusive lower bound of both entries.
    ordered : bool
        The pair is an inclusive range ``(min, max)``: the first entry must not exceed
        the second.

    Returns
    -------
    tuple of (int, int)

    Raises
    ------
    ValueError
        ``"{name} must be a pair of integers, got {value!r}"`` (``"a (min, max) pair"``
        when ``ordered``) for something that is not two items, :func:`check_int`'s
        messages for a bad entry, ``"{name} = {value!r}: min exceeds max"`` for a
        reversed range.
    """
    what = "a (min, max) pair" if ordered else "a pair"
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be {what} of integers, got {value!r}") from None
    if len(items) != 2:
        raise ValueError(f"{name} must be {what} of integers, got {value!r}")
    a = check_int(f"{name}[0]", items[0], minimum=minimum)
    b = check_int(f"{name}[1]", items[1], minimum=minimum)
    if ordered and a > b:
        raise ValueError(f"{name} = {value!r}: min exceeds max")
    return a, b


def check_int_array(name: str, value: Any, *, ndim: int = 1, keep_dtype: bool = False) -> np.ndarray:
    """``value`` as an ``ndim``-dimensional integer numpy array, else ``ValueError``.

    Parameters
    ----------
    name : str
        What the array is, as the message names it.
    value : array_like
        Integers of any integer dtype (an empty array may have any dtype).
    ndim : int
        Required dimensions.
    keep_dtype : bool
        Return the array in its own integer dtype (no copy) instead of int64; ``uint64``
        still becomes int64.

    Returns
    -------
    ndarray
        int64 (or, with ``keep_dtype``, the input's integer dtype); an empty input gives
        an empty int64 array of its shape.

    Raises
    ------
    ValueError
        ``"{name} must be a {ndim}-D integer array, got shape ..."``, ``"{name} must hold
        integers, got dtype ..."``, or ``"{name} holds ..., beyond the int64 range"``
        (a ``uint64`` value past ``2**63 - 1``).
    """
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {arr.shape}")
    if not arr.size:
        return np.zeros(arr.shape, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"{name} holds {int(arr.max())}, beyond the int64 range")
    if keep_dtype and arr.dtype != np.uint64:
        return arr
    return arr.astype(np.int64, copy=False)
