"""`nonfinite="error"`: the error clipax raises, and how it reaches the user.

Under `jax.jit` the check runs on the host through `jax.debug.callback`; JAX
then stops the program with a `jax.errors.JaxRuntimeError` whose message holds
ours. `nonfinite_errors` turns that back into a `NonFiniteError` (a
`FloatingPointError`), and a logging filter keeps JAX from logging the
callback's traceback, which the user sees once, in the exception.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])

MARKER = "(nonfinite='error')"
_MESSAGE = re.compile(r"NonFiniteError: ([^\n]*" + re.escape(MARKER) + r"\.?)")
NO_HOST = (
    "`nonfinite`='error' checks the norm on the host through "
    "`jax.debug.callback`, which needs a CPU backend, and JAX has none here "
    "(JAX_PLATFORMS={platforms!r}). Add cpu to the platforms (for example "
    "JAX_PLATFORMS=cuda,cpu), or use nonfinite='nan' or 'zero' with "
    "`optax.apply_if_finite` or the state's `nonfinite_count`."
)


class NonFiniteError(FloatingPointError):
    """Raised by `nonfinite="error"` when a global norm is NaN or inf.

    A `FloatingPointError`, so `except FloatingPointError` catches it. Eagerly
    it is raised as is; under `jax.jit`, wrap the jitted step in
    `clipax.nonfinite_errors` to receive it (JAX itself raises it as a
    `jax.errors.JaxRuntimeError`). The message names the first leaf, by its
    path, that holds NaN or inf.

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


class _DropNonFiniteLogs(logging.Filter):
    """Drops JAX's log record of a callback that raised a `NonFiniteError`.

    JAX logs every exception a `jax.debug.callback` raises, with its traceback,
    at ERROR level, before stopping the program. For clipax's own error that
    log repeats the exception the user receives: this filter drops it, and
    only it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, NonFiniteError)


_FILTER = _DropNonFiniteLogs()
for _name in ("jax._src.debugging", "jax._src.callback"):
    _logger = logging.getLogger(_name)
    if _FILTER not in _logger.filters:
        _logger.addFilter(_FILTER)


def check_host_callback() -> None:
    """Raises ValueError when JAX has no CPU backend for the host check."""
    try:
        jax.local_devices(backend="cpu")
    except RuntimeError as error:
        platforms = getattr(jax.config, "jax_platforms", None)
        raise ValueError(NO_HOST.format(platforms=platforms)) from error


def from_runtime_error(error: BaseException) -> NonFiniteError | None:
    """The `NonFiniteError` that a `JaxRuntimeError` carries, if it carries one."""
    found = _MESSAGE.search(str(error))
    return NonFiniteError(found.group(1)) if found else None


def _forget_failed_tokens() -> None:
    """Drops JAX's runtime tokens that hold clipax's error, and only those.

    JAX keeps the token of the last computation on each device and waits for
    them all at interpreter exit; a token whose computation failed raises
    again there and is printed as "Exception ignored in atexit callback". The
    error has been raised to the user already, so its tokens are dropped.
    This reaches into `jax._src.dispatch`, JAX's private module: if it
    changes, the only cost is the message at exit.
    """
    try:
        from jax._src import dispatch

        tokens = dispatch.runtime_tokens
        tables = (tokens.current_tokens, tokens.output_runtime_tokens)
    except (ImportError, AttributeError):  # another JAX: leave the tokens
        return
    for table in tables:
        for key, token in list(table.items()):
            try:
                token.block_until_ready()
            except jax.errors.JaxRuntimeError as error:
                if from_runtime_error(error) is not None:
                    del table[key]


def nonfinite_errors(fn: F) -> F:
    """Makes `nonfinite="error"` raise `clipax.NonFiniteError` out of `fn`.

    Wrap the jitted training step (or any function that runs a clipax
    transformation with `nonfinite="error"`): the wrapped function waits for
    `fn`'s outputs (`jax.block_until_ready`), so that the error is raised at
    the call that met the broken step, and turns the `jax.errors.JaxRuntimeError`
    by which JAX stops a jitted program into the `NonFiniteError` (a
    `FloatingPointError`) that clipax raised on the host; other errors pass
    unchanged. This works under `jax.jit`, on sharded arrays and with several
    processes (each process raises it). Waiting for every step costs the
    overlap of host and device that asynchronous dispatch gives; use
    `nonfinite="error"` to find a broken step, and `optax.apply_if_finite` or
    the state's `nonfinite_count` in long runs.

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
        try:
            return jax.block_until_ready(fn(*args, **kwargs))
        except jax.errors.JaxRuntimeError as error:
            converted = from_runtime_error(error)
            if converted is None:
                raise
            _forget_failed_tokens()
            raise converted from None

    return wrapped  # type: ignore[return-value]
