"""examples/lm_spikes.py runs end to end (in smoke mode) and logs per layer."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from tests import helpers

# The script needs the `examples` extra; without it (`pip install -e ".[test]"`)
# this test is skipped, with the reason shown.
_MISSING = [
    name
    for name in ("flax", "sklearn", "matplotlib", "tqdm")
    if importlib.util.find_spec(name) is None
]
if _MISSING:
    pytest.skip(
        f"{', '.join(_MISSING)} not installed: the examples need "
        'pip install -e ".[examples]"',
        allow_module_level=True,
    )

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RULES = {
    "none",
    "optax.clip",
    "clipax.clip",
    "zclip",
    "adagc",
    "autoclip",
    "skip_spikes",
}
STEPS = 8
ROW = re.compile(
    r"^\s*(?P<rule>\S+)\s+(?P<lr>\S+)\s+(?P<seeds>\d+)\s+(?P<spikes>\S+)\s+"
    r"(?P<clipped>\S+)\s+(?P<skipped>\S+)\s+(?P<held>\S+)\s+"
    r"(?P<diverged>\d+)/(?P<runs>\d+)$",
    re.MULTILINE,
)


def test_lm_spikes(tmp_path: Path) -> None:
    out = helpers.run_script(
        EXAMPLES / "lm_spikes.py",
        *("--steps", str(STEPS), "--lrs", "0.01", "--seeds", "1"),
        cwd=tmp_path,
        MPLBACKEND="Agg",
    )
    # The stacked prefix: the scanned blocks have one layer axis.
    assert "'blocks': 1" in out and "'embed': 0" in out, out
    # The summary: one line per rule at the one learning rate and seed.
    rows = {m["rule"]: m for m in ROW.finditer(out)}
    assert set(rows) == RULES, out
    assert len(ROW.findall(out)) == len(RULES)
    for rule, row in rows.items():
        assert float(row["lr"]) == pytest.approx(0.01)
        assert int(row["seeds"]) == int(row["runs"]) == 1
        assert 0 <= float(row["clipped"]) <= STEPS, rule
        assert math.isfinite(float(row["held"])), rule
        assert 0 < float(row["held"]) < 8, rule  # ln(256) is 5.55
    assert float(rows["none"]["clipped"]) == 0
    for rule in RULES - {"skip_spikes"}:
        assert float(rows[rule]["skipped"]) == 0, rule
    # optax's clip and clipax's are the same rule: their runs differ by rounding.
    clipped = [float(rows[r]["clipped"]) for r in ("optax.clip", "clipax.clip")]
    assert abs(clipped[0] - clipped[1]) <= 1

    # The log: one line per rule and step, per-layer norms with the layer
    # index in the key, and the rules' own metrics.
    lines = (tmp_path / "lm_spikes_metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert len(logged) == len(RULES) * STEPS
    assert {r["rule"] for r in logged} == RULES
    for r in logged:
        assert {"rule", "lr", "seed", "step", "loss"} <= set(r)
        assert math.isfinite(r["loss"])
        assert any("blocks/0/" in k for k in r), sorted(r)
        assert any("blocks/1/" in k for k in r), sorted(r)
        norms = [v for k, v in r.items() if k.startswith("grads/")]
        assert norms and all(math.isfinite(v) and v >= 0 for v in norms)
    adagc = next(r for r in logged if r["rule"] == "adagc")
    layers = [k for k in adagc if re.match(r"0/adagc/params/blocks/\d+/.*/norm$", k)]
    assert {k.split("/")[4] for k in layers} == {"0", "1"}
    skip = next(r for r in logged if r["rule"] == "skip_spikes")
    assert "skip_spikes/skipped" in skip
    assert any(k.endswith("clip_by_global_norm/clipped") for k in skip)

    data = (tmp_path / "lm_spikes.png").read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000
