"""`nonfinite="error"`: the error clipax raises, and how it reaches the user.

Under `jax.jit` the check runs on the host through `jax.debug.callback`. While
a `nonfinite_errors` wrapper waits on a step, the check records its error
instead of raising it and the wrapper raises it once the step is done: the
jitted program then ends normally, so JAX logs nothing and keeps no failed
state to report at interpreter exit. Anywhere else the check raises, and JAX
stops the program with a `jax.errors.JaxRuntimeError` whose message holds
ours.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from clipax._checks import is_traced
from clipax._leaves import Leaves, path_str

F = TypeVar("F", bound=Callable[..., Any])

MARKER = "(nonfinite='error')"
# A check that raised with no `nonfinite_errors` waiting reaches the user as
# JAX's `JaxRuntimeError`, our message inside its text and our class gone:
# the one way back to a `NonFiniteError` is to read the message.
_MESSAGE = re.compile(r"NonFiniteError: ([^\n]*" + re.escape(MARKER) + r"\.?)")


class NonFiniteError(FloatingPointError):
    """Raised by `nonfinite="error"` when a global norm is NaN or inf.

    A `FloatingPointError`, so `except FloatingPointError` catches it. Eagerly
    it is raised as is; under `jax.jit`, wrap the jitted step in
    `clipax.nonfinite_errors` to receive it (without the wrapper JAX raises it
    as a `jax.errors.JaxRuntimeError`). The message names the first leaf, by
    its path, that holds NaN or inf.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> try:
      ...     clipax.tree.clip_by_global_norm(
      ...         {"b": jnp.array([jnp.nan])}, 1.0, nonfinite="error"
      ...     )
      ... except FloatingPointError as error:
      ...     print(isinstance(error, clipax.NonFiniteError), "['b']" in str(error))
      True True
    """


NonFiniteError.__module__ = "clipax"  # as users name it: clipax.NonFiniteError


class _Waiting:
    """How many `nonfinite_errors` calls are waiting on a step, and the errors
    that the host checks met meanwhile (the checks run on JAX's threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.errors: list[NonFiniteError] = []


_WAITING = _Waiting()


def _error(fn_name: str, paths: list[str], finite: Any) -> NonFiniteError:
    """The error naming the first leaf that is not finite."""
    for path, ok in zip(paths, finite, strict=True):
        if not ok:
            return NonFiniteError(
                f"{fn_name}: the leaf at {path} holds NaN or inf {MARKER}."
            )
    return NonFiniteError(
        f"{fn_name}: the global norm is not finite although every leaf "
        f"is: it exceeds the largest float32 {MARKER}."
    )


def _host_bool(x: jax.Array) -> bool:
    """A replicated scalar's value, also where other processes hold it too."""
    return bool(np.asarray(x.addressable_data(0)))


def raise_if_nonfinite(leaves: Leaves, finite: jax.Array, fn_name: str) -> None:
    """Raises `NonFiniteError` now (eagerly), or from a host callback on every
    device (traced), when `finite` is False."""
    paths = [path_str(leaf.path) for leaf in leaves] or ["<none>"]
    if not is_traced(finite):
        if not _host_bool(finite):
            flags = [_host_bool(jnp.all(jnp.isfinite(x))) for x in leaves.arrays]
            raise _error(fn_name, paths, flags or [False])
        return
    leaf_flags = [jnp.all(jnp.isfinite(x)) for x in leaves.arrays] or [finite]

    def check(ok: jax.Array, flags: jax.Array) -> None:
        if not ok:
            raise_or_record(_error(fn_name, paths, flags))

    # Partitioned: every device checks its copy of these replicated flags, so
    # that every process of a multi-process job raises.
    jax.debug.callback(check, finite, jnp.stack(leaf_flags), partitioned=True)


def raise_or_record(error: NonFiniteError) -> None:
    """What the host check does with its error: records it for a waiting
    `nonfinite_errors` call, or, when none waits, raises it (to JAX)."""
    with _WAITING.lock:
        if _WAITING.count:
            _WAITING.errors.append(error)
            return
    raise error


def nonfinite_errors(fn: F) -> F:
    """Makes `nonfinite="error"` raise `clipax.NonFiniteError` out of `fn`.

    Wrap the jitted training step (or any function that runs a clipax
    transformation with `nonfinite="error"`): the wrapped function waits for
    `fn`'s outputs (`jax.block_until_ready`), so that the error is raised at
    the call that met the broken step, as a `NonFiniteError` (a
    `FloatingPointError`). While it waits, clipax's host checks record their
    error instead of raising it, so the jitted program ends normally: JAX logs
    nothing and has nothing to report at interpreter exit. A
    `jax.errors.JaxRuntimeError` that carries a clipax error (a step run
    without the wrapper) is turned into the `NonFiniteError` too; other errors
    pass unchanged. This works under `jax.jit`, on sharded arrays and with
    several processes (each process raises it); with steps running in several
    threads at once, an error goes to whichever waiting call ends first.
    Waiting for every step costs the overlap of host and device that
    asynchronous dispatch gives; use `nonfinite="error"` to find a broken
    step, and `optax.apply_if_finite` or the state's `nonfinite_count` in long
    runs.

    Args:
      fn: the function to wrap, typically `jax.jit(train_step)`.

    Returns:
      `fn`, raising `clipax.NonFiniteError` where a clipax check failed.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
      >>> update = clipax.nonfinite_errors(jax.jit(tx.update))
      >>> grads = {"w": jnp.array([1.0, jnp.inf])}
      >>> try:
      ...     update(grads, tx.init(grads))
      ... except FloatingPointError as error:
      ...     print(type(error).__name__, str(error)[21:55])
      NonFiniteError the leaf at ['w'] holds NaN or inf
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # Counted before `fn` dispatches: on CPU the checks can run inside
        # that call. A step's outputs are ready only after its host
        # callbacks have returned, so once they are, its errors are in.
        with _WAITING.lock:
            _WAITING.count += 1
        try:
            out = jax.block_until_ready(fn(*args, **kwargs))
        except jax.errors.JaxRuntimeError as error:
            found = _MESSAGE.search(str(error))  # a clipax error that JAX carries
            if found is None:
                raise
            raise NonFiniteError(found.group(1)) from None
        finally:
            with _WAITING.lock:
                _WAITING.count -= 1
                met, _WAITING.errors = _WAITING.errors, []
        if met:
            raise met[0]
        return out

    return wrapped  # type: ignore[return-value]
