"""Run by test_nonfinite.py in a fresh interpreter with 8 CPU devices.

Each way of running `nonfinite="error"` must end in `except FloatingPointError`
with the leaf's path; the test checks that nothing else reaches stdout or
stderr (no ERROR log, nothing printed at exit).
"""

import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax


def main() -> None:
    # Axis types named: JAX 0.8.3 warns that the default changes in 0.9.
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    specs = {"w": P("d"), "b": P()}
    w = np.ones((8, 4), np.float32)
    bad = {"w": w, "b": np.array([1.0, np.nan], np.float32)}
    sharded = {
        k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in bad.items()
    }
    tx = clipax.clip_by_global_norm(1.0, nonfinite="error")

    def shard_mapped(tree):
        def inner(t):
            return clipax.tree.clip_by_global_norm(
                t, 1.0, specs=specs, nonfinite="error"
            )[1]

        return jax.shard_map(inner, mesh=mesh, in_specs=(specs,), out_specs=P())(tree)

    def pmapped(tree):
        def inner(t):
            return clipax.tree.clip_by_global_norm(
                t, 1.0, axis_name="i", nonfinite="error"
            )[1]

        return jax.pmap(inner, axis_name="i")(tree)

    runs = {
        "eager": lambda: tx.update(bad, tx.init(bad)),
        "jit": clipax.nonfinite_errors(jax.jit(tx.update)),
        "sharded": clipax.nonfinite_errors(jax.jit(tx.update)),
        "shard_map": clipax.nonfinite_errors(jax.jit(shard_mapped)),
        "pmap": clipax.nonfinite_errors(pmapped),
    }
    arguments = {
        "eager": (),
        "jit": (bad, tx.init(bad)),
        "sharded": (sharded, tx.init(sharded)),
        "shard_map": (sharded,),
        "pmap": ({"w": w.reshape(8, 1, 4), "b": np.stack([bad["b"]] * 8)},),
    }
    for name, run in runs.items():
        try:
            run(*arguments[name])
        except FloatingPointError as error:
            assert isinstance(error, clipax.NonFiniteError), type(error)
            print(f"{name}: {error}", flush=True)
        else:
            raise AssertionError(f"{name}: no error")
    # A finite step afterwards runs normally.
    good = {"w": w, "b": np.ones(2, np.float32)}
    print("finite:", float(runs["jit"](good, tx.init(good))[1].norm), flush=True)


if __name__ == "__main__":
    # Before JAX starts its backend (lazily, on first use); only here, since
    # pytest imports this module when it collects doctests.
    # The platform through the config, not JAX_PLATFORMS, which JAX read when
    # it was imported: on a GPU machine (CLIPAX_TEST_DEVICES=native) the
    # variable is unset and the GPU would be taken.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    jax.config.update("jax_platforms", "cpu")
    main()
