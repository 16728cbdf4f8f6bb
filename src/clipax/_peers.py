"""Peers' calls: every clipax name that replaces a peer's takes the peer's call.

A clipax function that replaces one of optax, TensorFlow or PyTorch takes that
function's arguments in the peer's positional order (for a transformation that
replaces a function taking the gradients first, the arguments after them). Its
parameters carry clipax's names; where a peer names one otherwise, the peer's
name is an alias, accepted by keyword. Arguments that only steer the peer's
execution (TensorFlow's `name`, PyTorch's `foreach`) are accepted and ignored.
`peer_names` adds this to a function from a table, so every function handles
aliases, conflicts and ignored arguments the same way.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from clipax import _common

F = TypeVar("F", bound=Callable[..., Any])

# What each ignored argument is, for the error message of a wrong value.
IGNORED = {
    "name": "TensorFlow's name for the operation",
    "foreach": "PyTorch's choice of kernels",
}
IGNORED_ACCEPTED = "None, a bool or a string"


def check_ignored(fn_name: str, name: str, value: Any) -> None:
    """An argument clipax ignores must still be what a peer accepts there.

    TensorFlow's `name` is a string and PyTorch's `foreach` a bool; a position
    one peer gives to `name` another may give to `foreach`, so both kinds are
    accepted in either. Anything else is likely a value meant for another
    argument, and is refused.

    Raises:
      TypeError: naming the argument and the value.
    """
    if value is None or isinstance(value, (bool, str)):
        return
    raise TypeError(
        f"`{fn_name}` ignores `{name}` ({IGNORED[name]}, which means nothing in "
        f"JAX) but takes only {IGNORED_ACCEPTED} there; got "
        f"{_common.short_repr(value)} of type {type(value).__name__}."
    )


def peer_names(
    aliases: Mapping[str, str] | None = None, ignored: Sequence[str] = ()
) -> Callable[[F], F]:
    """Makes a function accept its peers' argument names.

    Args:
      aliases: each peer's name for one of the function's parameters, mapped
        to that parameter's name. Given by keyword, an alias is passed on as
        the parameter; given together with the parameter (or with another
        alias of it), it is a `TypeError` naming both.
      ignored: the peers' arguments the function ignores (keys of `IGNORED`).
        One that is a parameter of the function (a position in a peer's call)
        stays one, and the function must ignore it; the others are accepted
        by keyword and dropped. Either way its value is checked
        (`check_ignored`).

    Returns:
      A decorator. The decorated function keeps its signature, which is what
      `inspect.signature` (and so `optax.inject_hyperparams`) sees.
    """
    aliases = dict(aliases or {})
    unknown = [name for name in ignored if name not in IGNORED]
    if unknown:
        raise ValueError(f"no such ignored peer argument: {unknown}")

    def decorate(fn: F) -> F:
        parameters = inspect.signature(fn).parameters
        missing = [own for own in aliases.values() if own not in parameters]
        if missing:
            raise ValueError(f"`{fn.__name__}` has no parameter {missing}")
        positions = {
            name: index
            for index, (name, p) in enumerate(parameters.items())
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        }
        in_signature = [(n, positions[n]) for n in ignored if n in positions]
        dropped = [n for n in ignored if n not in parameters]
        in_tree = fn.__module__.startswith("clipax.tree")
        fn_name = ("clipax.tree." if in_tree else "clipax.") + fn.__name__

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                for alias in [a for a in aliases if a in kwargs]:
                    own = aliases[alias]
                    given = [n for n, o in aliases.items() if o == own and n in kwargs]
                    if own in kwargs or positions.get(own, len(args)) < len(args):
                        given.insert(0, own)
                    if len(given) > 1:
                        names = " and ".join(f"`{n}`" for n in given)
                        raise TypeError(
                            f"`{fn_name}` got {names}, which name the same "
                            f"argument (`{own}`); pass one of them."
                        )
                    kwargs[own] = kwargs.pop(alias)
                for name in dropped:
                    if name in kwargs:
                        check_ignored(fn_name, name, kwargs.pop(name))
            for name, index in in_signature:
                value = args[index] if index < len(args) else kwargs.get(name)
                check_ignored(fn_name, name, value)
            return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate
