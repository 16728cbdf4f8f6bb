"""One of two processes forming one JAX runtime (run by test_multiprocess.py).

Usage: python _multiprocess_worker.py PROCESS_ID PORT [nonfinite]

Each process has 2 CPU devices; together they form a (2, 2) mesh. Clipping on
the global arrays (GSPMD and shard_map) must give, on this process's shards,
what clipping the whole arrays on one process gives, and the same logged norm.
"""

import os
import sys

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax

SPECS = {"w": P("data", "model"), "b": P("model"), "r": P()}


def nonfinite_error(process_id: int, sharded: dict) -> None:
    """`nonfinite="error"` raises clipax.NonFiniteError in every process."""
    broken = dict(sharded)
    broken["r"] = broken["r"] * np.float32(np.nan)
    tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
    update = clipax.nonfinite_errors(jax.jit(tx.update))
    try:
        update(broken, tx.init(broken))
    except FloatingPointError as error:
        assert isinstance(error, clipax.NonFiniteError), type(error)
        assert "the leaf at ['r'] holds NaN or inf" in str(error), str(error)
    else:
        raise AssertionError("no error for a NaN leaf")
    _, state = update(sharded, tx.init(sharded))  # a finite step runs on
    assert np.isfinite(np.asarray(state.norm.addressable_data(0)))
    print(f"process {process_id}: OK nonfinite", flush=True)


def main(process_id: int, port: int, mode: str = "clip") -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == 2 and jax.device_count() == 4
    assert jax.local_device_count() == 2
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    # Both processes make the same host data; each holds its own shards.
    rng = np.random.default_rng(0)
    host = {
        "w": (5 * rng.normal(size=(4, 6))).astype(np.float32),
        "b": (5 * rng.normal(size=(6,))).astype(np.float32),
        "r": (5 * rng.normal(size=(3,))).astype(np.float32),
    }
    sharded = {
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, SPECS[k]), lambda idx, v=v: v[idx]
        )
        for k, v in host.items()
    }
    if mode == "nonfinite":
        nonfinite_error(process_id, sharded)
        jax.distributed.shutdown()
        return
    # The reference: the whole arrays, on this process alone.
    expected, expected_norm = clipax.tree.clip_by_global_norm(host, 1.0)
    expected = {k: np.asarray(v) for k, v in expected.items()}

    def check_shards(tree: dict, what: str) -> None:
        for key, leaf in tree.items():
            for shard in leaf.addressable_shards:
                np.testing.assert_allclose(
                    np.asarray(shard.data),
                    expected[key][shard.index],
                    rtol=1e-6,
                    err_msg=f"{what}: leaf {key}, shard {shard.index}",
                )

    def check_norm(norm: jax.Array, what: str) -> None:
        value = np.asarray(norm.addressable_data(0))
        np.testing.assert_allclose(value, expected_norm, rtol=1e-6, err_msg=what)

    # GSPMD: jit over the global arrays, no arguments.
    tx = clipax.clip_by_global_norm(1.0)
    updates, state = jax.jit(tx.update)(sharded, tx.init(sharded))
    check_shards(updates, "transformation under jit")
    check_norm(state.norm, "logged norm under jit")
    clipped, norm = jax.jit(lambda t: clipax.tree.clip_by_global_norm(t, 1.0))(sharded)
    check_shards(clipped, "tree function under jit")
    check_norm(norm, "tree function norm under jit")
    check_norm(jax.jit(clipax.tree.global_norm)(sharded), "global_norm under jit")

    # shard_map: local blocks, with specs.
    tx_specs = clipax.clip_by_global_norm(1.0, specs=SPECS)
    state_specs = clipax.ClipByGlobalNormState(
        norm=P(), nonfinite_count=P(), threshold=P()
    )
    step = jax.jit(
        jax.shard_map(
            lambda t: tx_specs.update(t, tx_specs.init(t)),
            mesh=mesh,
            in_specs=(SPECS,),
            out_specs=(SPECS, state_specs),
        )
    )
    updates, state = step(sharded)
    check_shards(updates, "transformation in shard_map")
    check_norm(state.norm, "logged norm in shard_map")
    skips = check_skip_spikes(mesh, sharded)
    print(f"process {process_id}: skips={skips}", flush=True)
    print(f"process {process_id}: OK norm={float(expected_norm):.6f}", flush=True)
    jax.distributed.shutdown()


def check_skip_spikes(mesh: jax.sharding.Mesh, sharded: dict) -> str:
    """skip_spikes under GSPMD and in shard_map: the same decisions, the same
    on every local device, as on one process; returns them as a string."""
    scales = [1.0, 1.1, 0.9, 1.05, 40.0, 1.0]
    expected = [False, False, False, False, True, False]
    scale = jax.jit(lambda t, s: jax.tree.map(lambda x: x * s, t))
    gspmd = clipax.skip_spikes(optax.sgd(1.0), warmup_steps=3)
    in_map = clipax.skip_spikes(optax.sgd(1.0), warmup_steps=3, specs=SPECS)
    state_specs = jax.tree.map(lambda _: P(), gspmd.init(sharded))
    map_step = jax.jit(
        jax.shard_map(
            in_map.update,
            mesh=mesh,
            in_specs=(SPECS, state_specs),
            out_specs=(SPECS, state_specs),
        )
    )
    replicated = NamedSharding(mesh, P())
    states = [jax.jit(gspmd.init, out_shardings=replicated)(sharded)] * 2
    decisions = []
    for s in scales:
        grads = scale(sharded, np.float32(s))
        _, states[0] = jax.jit(gspmd.update)(grads, states[0])
        _, states[1] = map_step(grads, states[1])
        for state in states:
            local = {bool(x.data) for x in state.skipped.addressable_shards}
            assert len(local) == 1, f"devices disagree: {local}"
        got = [bool(state.skipped.addressable_data(0)) for state in states]
        assert got[0] == got[1], f"GSPMD and shard_map disagree at scale {s}"
        decisions.append(got[0])
    assert decisions == expected, decisions
    return "".join("S" if d else "." for d in decisions)


if __name__ == "__main__":
    # Before JAX starts its backend (it does so lazily, on first use). Only
    # here: pytest imports this module when it collects doctests.
    # The platform through the config, not JAX_PLATFORMS, which JAX read when
    # it was imported: on a GPU machine (CLIPAX_TEST_DEVICES=native) the
    # variable is unset and the GPU would be taken.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    jax.config.update("jax_platforms", "cpu")
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
