"""The example scripts run end to end (in smoke mode) and write their pictures."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from tests import helpers

# The scripts need the `examples` extra; without it (`pip install -e ".[test]"`)
# these tests are skipped, with the reason shown.
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


def run_example(name: str, *args: str, cwd: Path) -> str:
    """Runs `examples/<name>` in `cwd` with this interpreter; returns stdout."""
    return helpers.run_script(EXAMPLES / name, *args, cwd=cwd, MPLBACKEND="Agg")


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path.name} was not written"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), f"{path.name} is not a PNG"
    assert len(data) > 10_000, f"{path.name} is suspiciously small ({len(data)} B)"


def test_quickstart(tmp_path: Path) -> None:
    out = run_example("quickstart.py", "--steps", "20", cwd=tmp_path)
    rows = re.findall(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(yes|no)$", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == list(range(1, 21))
    losses = [float(r[1]) for r in rows]
    norms = [float(r[2]) for r in rows]
    assert all(math.isfinite(v) for v in losses + norms)
    assert all(n > 0 for n in norms)  # the norm read from the state is filled in
    assert losses[-1] < losses[0]
    # "clipped" is exactly norm > max_norm (1.0), as printed.
    assert [r[3] == "yes" for r in rows] == [n > 1.0 for n in norms]
    clipped = int(re.search(r"^clipped steps: (\d+) of 20$", out, re.M).group(1))
    assert clipped == sum(n > 1.0 for n in norms)
    assert re.search(r"^test accuracy: 0\.\d+", out, re.MULTILINE)


def parse_summary(out: str, run: str) -> dict[str, str]:
    line = next(line for line in out.splitlines() if line.startswith(f"summary: {run}"))
    return dict(re.findall(r"(\w+)=(\S+)", line.split(": ", 2)[2]))


def test_exploding_gradients(tmp_path: Path) -> None:
    out = run_example("exploding_gradients.py", "--steps", "30", cwd=tmp_path)
    assert_png(tmp_path / "exploding_gradients.png")

    # The tutorial's print-out: every leaf's norm before and after clipping.
    assert "== unclipped ==" in out and "== clipped (max_norm=1) ==" in out
    clipped_part = out.split("== clipped (max_norm=1) ==")[1]
    assert re.search(r"^step 1: loss \S+, global norm \S+ -> 1$", clipped_part, re.M)
    table = re.findall(
        r"^  (Dense_\d/(?:kernel|bias))\s+(\S+)\s+(\S+)$", clipped_part, re.M
    )
    first_step = table[:10]  # 5 Dense layers, kernel and bias each
    assert len(first_step) == 10
    before = [float(b) for _, b, _ in first_step]
    after = [float(a) for _, _, a in first_step]
    assert math.sqrt(sum(a * a for a in after)) == pytest.approx(1.0, rel=1e-2)
    ratios = [a / b for b, a in zip(before, after, strict=True)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-2)  # one factor

    unclipped = parse_summary(out, "unclipped")
    clipped = parse_summary(out, "clipped")
    diverged = unclipped["first_nonfinite_step"] != "none" or (
        float(unclipped["max_loss"]) > 1e6
    )
    assert diverged, unclipped
    assert clipped["first_nonfinite_step"] == "none", clipped
    assert math.isfinite(float(clipped["final_loss"]))
    assert float(clipped["max_loss"]) < 100
    assert float(clipped["test_acc"]) > float(unclipped["test_acc"])


def test_nnx_logging(tmp_path: Path) -> None:
    out = run_example(
        "nnx_logging.py", "--steps", "40", "--log-every", "10", cwd=tmp_path
    )
    assert_png(tmp_path / "nnx_logging.png")
    rows = re.findall(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)%$", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [10, 20, 30, 40]
    norms = [float(r[2]) for r in rows]
    max_norms = [float(r[3]) for r in rows]
    fractions = [int(r[4]) for r in rows]
    assert all(math.isfinite(n) and n > 0 for n in norms)
    # The warmup read back from the optimizer state: rising from 0.1 to 1.0.
    assert 0.1 < max_norms[0] < max_norms[1] <= max_norms[-1] == 1.0
    assert all(0 <= f <= 100 for f in fractions)
    overall = int(re.search(r"^clipped steps overall: (\d+)% of 40$", out, re.M)[1])
    assert overall == round(sum(fractions) / len(fractions))


SPIKE_RULES = {
    "no clipping",
    "fixed",
    "apply_if_finite",
    "zclip",
    "autoclip",
    "adagc",
    "skip_spikes",
}
SPIKE_LINE = re.compile(
    r"^\s*(?P<name>[\w ]+): loss before spikes\s+(?P<before>\S+), after them\s+"
    r"(?P<after>\S+), others kept\s+(?P<kept>\S+) at the local spike; test "
    r"accuracy before NaN (?P<acc>\S+), final (?P<final>\S+); clipped\s+"
    r"(?P<clipped>\d+) steps, skipped\s+(?P<skipped>\d+)$",
    re.MULTILINE,
)


def test_spikes(tmp_path: Path) -> None:
    out = run_example("spikes.py", "--steps", "60", cwd=tmp_path)
    runs = {m["name"]: m for m in SPIKE_LINE.finditer(out)}
    assert set(runs) == SPIKE_RULES, out
    # Unclipped, the x100 spikes ruin the run; every clipping rule survives them.
    for name in ("fixed", "zclip", "autoclip", "adagc", "skip_spikes"):
        assert float(runs[name]["after"]) < float(runs["no clipping"]["after"]) / 10
        assert float(runs[name]["acc"]) > 0.5
    # apply_if_finite skips the NaN step only; skip_spikes skips it too, and
    # is the one run that ends with a trained model.
    assert int(runs["apply_if_finite"]["skipped"]) == 1
    assert int(runs["skip_spikes"]["skipped"]) >= 1
    assert float(runs["skip_spikes"]["final"]) > 0.5
    for name in SPIKE_RULES - {"skip_spikes", "apply_if_finite"}:
        assert int(runs[name]["skipped"]) == 0
    # Every step of every rule is logged with clipax.metrics.
    lines = (tmp_path / "spikes_metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 60 * len(SPIKE_RULES)
    adagc = [r for r in rows if r["rule"] == "adagc"][-1]
    assert any(k.endswith("kernel/ema") for k in adagc)
    # At the one-tensor spike, AdaGC keeps the other tensors' update; the
    # global rules scale it down with the spiked tensor.
    for name in ("fixed", "zclip", "autoclip"):
        assert float(runs[name]["kept"]) < 0.05
        assert float(runs["adagc"]["kept"]) > 20 * float(runs[name]["kept"])
    assert_png(tmp_path / "spikes.png")


LM_RULES = {
    "none",
    "optax.clip",
    "clipax.clip",
    "zclip",
    "adagc",
    "autoclip",
    "skip_spikes",
    "trainers.skip",
    "levanter.update_clip",
    "stable_spam",
}
LM_STEPS = 8
LM_ROW = re.compile(
    r"^\s*(?P<rule>\S+)\s+(?P<lr>\S+)\s+(?P<seeds>\d+)\s+(?P<spikes>\S+)\s+"
    r"(?P<clipped>\S+)\s+(?P<skipped>\S+)\s+(?P<held>\S+)\s+"
    r"(?P<diverged>\d+)/(?P<runs>\d+)$",
    re.MULTILINE,
)


def test_lm_spikes(tmp_path: Path) -> None:
    out = run_example(
        "lm_spikes.py",
        *("--steps", str(LM_STEPS), "--lrs", "0.01", "--seeds", "1"),
        cwd=tmp_path,
    )
    # The stacked prefix: the scanned blocks have one layer axis.
    assert "'blocks': 1" in out and "'embed': 0" in out, out
    # The summary: one line per rule at the one learning rate and seed.
    rows = {m["rule"]: m for m in LM_ROW.finditer(out)}
    assert set(rows) == LM_RULES, out
    assert len(LM_ROW.findall(out)) == len(LM_RULES)
    for rule, row in rows.items():
        assert float(row["lr"]) == pytest.approx(0.01)
        assert int(row["seeds"]) == int(row["runs"]) == 1
        assert 0 <= float(row["clipped"]) <= LM_STEPS, rule
        assert math.isfinite(float(row["held"])), rule
        assert 0 < float(row["held"]) < 8, rule  # ln(256) is 5.55
    assert float(rows["none"]["clipped"]) == 0
    for rule in LM_RULES - {"skip_spikes", "trainers.skip"}:
        assert float(rows[rule]["skipped"]) == 0, rule
    # optax's clip and clipax's are the same rule: their runs differ by rounding.
    clipped = [float(rows[r]["clipped"]) for r in ("optax.clip", "clipax.clip")]
    assert abs(clipped[0] - clipped[1]) <= 1

    # The log: one line per rule and step, per-layer norms with the layer
    # index in the key, and the rules' own metrics.
    lines = (tmp_path / "lm_spikes_metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert len(logged) == len(LM_RULES) * LM_STEPS
    assert {r["rule"] for r in logged} == LM_RULES
    for r in logged:
        assert {"rule", "lr", "seed", "step", "loss"} <= set(r)
        assert math.isfinite(r["loss"])
        assert any("blocks/0/" in k for k in r), sorted(r)
        assert any("blocks/1/" in k for k in r), sorted(r)
        norms = [v for k, v in r.items() if k.startswith("grads/")]
        assert norms and all(math.isfinite(v) and v >= 0 for v in norms)
    adagc = next(r for r in logged if r["rule"] == "adagc")
    layers = [k for k in adagc if re.match(r"adagc/params/blocks/\d+/.*/norm$", k)]
    assert {k.split("/")[3] for k in layers} == {"0", "1"}
    skip = next(r for r in logged if r["rule"] == "skip_spikes")
    assert "skip_spikes/skipped" in skip
    assert any(k.endswith("clip_by_global_norm/clipped") for k in skip)

    assert_png(tmp_path / "lm_spikes.png")


QK_RUNS = {"adamw", "adamw+qk_clip", "muon", "muon+qk_clip"}
QK_STEPS = 6
QK_ROW = re.compile(
    r"^\s*(?P<run>\S+)\s+(?P<lr>\S+)\s+(?P<seeds>\d+)\s+(?P<peak>\S+)\s+"
    r"(?P<last>\S+)\s+(?P<clips>\S+)\s+(?P<spikes>\S+)\s+(?P<ratio>\S+)\s+"
    r"(?P<held>\S+)\s+(?P<diverged>\d+)/(?P<runs>\d+)$",
    re.MULTILINE,
)


def test_lm_spikes_qk_clip(tmp_path: Path) -> None:
    # tau 1: at lr 0.1 the largest logit passes it in the first steps.
    out = run_example(
        "lm_spikes.py",
        *("--qk-clip", "--steps", str(QK_STEPS), "--lrs", "0.1", "--seeds", "1"),
        *("--tau", "1"),
        cwd=tmp_path,
    )
    rows = {m["run"]: m for m in QK_ROW.finditer(out)}
    assert set(rows) == QK_RUNS, out
    for run, row in rows.items():
        assert float(row["lr"]) == pytest.approx(0.1)
        assert int(row["seeds"]) == int(row["runs"]) == 1
        assert 0 < float(row["held"]) < 8, run
        assert float(row["last"]) <= float(row["peak"]), run
        clipped = "+qk_clip" in run
        assert (float(row["clips"]) > 0) == clipped, run  # 8 heads a step at most
        assert float(row["clips"]) <= 8 * QK_STEPS, run

    # The log: per step the largest logit of each layer; with QK-Clip, its
    # state per layer of the scanned blocks, read by clipax.metrics.
    lines = (tmp_path / "lm_qk_clip_metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert len(logged) == len(QK_RUNS) * QK_STEPS
    first = {r["run"]: r for r in logged if r["step"] == 0}
    for name in ("adamw", "muon"):  # the same model, batch and step 0
        assert first[name]["max_logit/0"] == first[f"{name}+qk_clip"]["max_logit/0"]
    for r in logged:
        assert math.isfinite(r["loss"]) and math.isfinite(r["max_logit/1"])
        keys = [k for k in r if k.startswith("qk_clip/")]
        if "+qk_clip" not in r["run"]:
            assert not keys, r
            continue
        for layer in (0, 1):  # each head's largest logit, layers first
            heads = [
                r[f"qk_clip/params/blocks/{layer}/attn/{h}/max_logit"] for h in range(4)
            ]
            assert max(heads) == pytest.approx(r[f"max_logit/{layer}"], rel=1e-3)
            assert 0 <= r[f"qk_clip/params/blocks/{layer}/attn/clipped_heads"] <= 4
        assert r["wq/wk"] > 0
    assert_png(tmp_path / "lm_qk_clip.png")


def test_lm_spikes_qk_clip_gqa(tmp_path: Path) -> None:
    # The GQA variant: 4 query heads over 2 key heads; each rule for a group.
    out = run_example(
        "lm_spikes.py",
        *("--qk-clip", "--gqa", "--steps", "4", "--lrs", "0.1", "--seeds", "1"),
        *("--tau", "1"),
        cwd=tmp_path,
    )
    rows = {m["run"]: m for m in QK_ROW.finditer(out)}
    names = {"adamw", "muon"}
    assert set(rows) == names | {
        f"{n}+qk_clip{g}" for n in names for g in ("", "[group]")
    }
    for run, row in rows.items():
        assert (float(row["clips"]) > 0) == ("+qk_clip" in run), run
        assert math.isfinite(float(row["ratio"])), run
    # Megatron's rule shrinks every query head of a clipped group; the default
    # only as far as each must: its query kernels keep more of their norm.
    for name in names:
        assert float(rows[f"{name}+qk_clip"]["ratio"]) >= float(
            rows[f"{name}+qk_clip[group]"]["ratio"]
        ), out
    logged = (tmp_path / "lm_qk_gqa_metrics.jsonl").read_text().splitlines()
    assert len(logged) == 6 * 4
    assert_png(tmp_path / "lm_qk_gqa.png")


RESET_ROW = re.compile(
    r"^\s*(?P<run>\S+/\S+)\s+(?P<lr>\S+)\s+(?P<spikes>\S+)\s+(?P<recover>\S+)\s+"
    r"(?P<resets>\S+)\s+(?P<skipped>\S+)\s+(?P<held>\S+)\s+"
    r"(?P<diverged>\d+)/(?P<runs>\d+)$",
    re.MULTILINE,
)


def test_lm_spikes_reset(tmp_path: Path) -> None:
    out = run_example(
        "lm_spikes.py",
        *("--reset", "--steps", "3", "--lrs", "0.1", "--seeds", "1"),
        cwd=tmp_path,
    )
    rows = {m["run"]: m for m in RESET_ROW.finditer(out)}
    rules = ("none", "reset_on_spike", "trainers.skip", "stable_spam", "adagc")
    assert set(rows) == {f"{o}/{r}" for o in ("adamw", "muon") for r in rules}, out
    for run, row in rows.items():
        assert float(row["held"]) > 0, run
        assert float(row["resets"]) == 0 or run.endswith("reset_on_spike"), run
    logged = [
        json.loads(line)
        for line in (tmp_path / "lm_reset_metrics.jsonl").read_text().splitlines()
    ]
    assert len(logged) == 10 * 3
    reset = next(r for r in logged if r["rule"] == "adamw/reset_on_spike")
    assert any(k.startswith("reset_on_spike/params/blocks/1/") for k in reset), reset
    assert_png(tmp_path / "lm_reset.png")


def test_lm_spikes_spectral(tmp_path: Path) -> None:
    # SPECTRA's clip on AdamW's direction beside the global clip, AdaGC, nothing
    # and Muon: every run in the summary, seed by seed, and its log.
    out = run_example(
        "lm_spikes.py",
        *("--spectral", "--steps", "2", "--lrs", "0.1", "--seeds", "1"),
        cwd=tmp_path,
    )
    rows = {m["run"]: m for m in RESET_ROW.finditer(out)}
    runs = {"adamw/none", "adamw/clip", "adamw/adagc", "adamw/spectra", "muon/none"}
    assert set(rows) == runs, out
    assert all(f"  {run} @ 0.1:" in out for run in runs), out
    for run, row in rows.items():
        assert float(row["held"]) > 0, run
    logged = (tmp_path / "lm_spectral_metrics.jsonl").read_text().splitlines()
    spectra = [json.loads(line) for line in logged if '"adamw/spectra"' in line]
    assert len(logged) == 5 * 2 and spectra
    assert any(k.endswith("/sigma_max") for k in spectra[0]), spectra[0]
    assert_png(tmp_path / "lm_spectral.png")
