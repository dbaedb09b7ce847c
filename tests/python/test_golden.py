"""Golden forecasts: every forecast from committed inputs is what it was when tests/data/golden/expected.json.gz was
written (tests/golden/golden_cases.py says which inputs and settings). A restructuring of the code changes none of
them; a change of behaviour rewrites the file in its own commit that says why.

Compared bit for bit (floats as JSON's shortest round-trip text), except where a stated tolerance below says
otherwise."""
import gzip
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
import golden_cases  # noqa: E402

# Stated exceptions to bit-for-bit equality: (section, field) -> relative tolerance; every other value exact.
# - gnn step_ms: the graph's corrected step by the one rule of forecasts and graphs (step_gnn.h: corrected_step_ms,
#   sum + comm + (alpha - 1) sum + (beta - 1) comm) instead of alpha sum + beta comm: the same value, rounded
#   otherwise (6 of the 448 recorded graphs differ in the last bit).
TOLERANCES: dict = {("gnn", "step_ms"): 1e-12}


@pytest.fixture(scope="module")
def actual():
    return golden_cases.normalised(golden_cases.compute())


@pytest.fixture(scope="module")
def expected():
    return json.loads(gzip.decompress(golden_cases.EXPECTED.read_bytes()))


def differences(a, b, path: str, section: str, out: list, field: str = "") -> None:
    """Where a and b differ, as 'path: a != b' lines (at most 20 gathered); field: the innermost key."""
    if len(out) >= 20:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {'missing' if k not in a else 'new'}")
            else:
                differences(a[k], b[k], f"{path}.{k}", section, out, k)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            differences(x, y, f"{path}[{i}]", section, out, field)
    elif type(a) is not type(b) or a != b:
        tol = TOLERANCES.get((section, field), 0.0)
        if not (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=tol, abs_tol=0.0)):
            out.append(f"{path}: {a!r} != {b!r}")


@pytest.mark.parametrize("section", ["memory", "time", "gnn"])
def test_forecasts_from_committed_inputs_are_unchanged(actual, expected, section):
    assert sorted(actual[section]) == sorted(expected[section])
    out: list = []
    for key in sorted(expected[section]):
        differences(actual[section][key], expected[section][key], f"{section}/{key}", section, out)
    assert not out, "\n".join(out)


def test_the_golden_set_covers_every_strategy_and_source(expected):
    # The stored set is what it claims: each strategy, both targets, the GPU probes and every recorded graph.
    units = sum(len(v) for v in golden_cases.FSDP_UNIT_SETTINGS.values())
    assert units == 3
    assert len(expected["memory"]) == len(golden_cases.ZOO_CASES) * len(golden_cases.MEMORY_SETTINGS) + 2 * 4 + units
    # FSDP2 with units: its own rule, exact (not approximate), one group of ranks (the GPT's rows divide evenly).
    for key in ("gpt/cpu_fsdp2_units", "gpt/h100_fsdp4_units_keep", "gpt/h100_fsdp4_units_to2"):
        m = expected["memory"][key]
        assert [n["code"] for n in m["notes"]].count("fsdp2-rule") == 1 and m["approximate"] is False
        assert len(m["per_rank"]) == 1 and m["per_rank"][0]["peak_allocated_bytes"] == m["peak_allocated_bytes"]
    assert len(expected["time"]) == len(golden_cases.ZOO_CASES) * len(golden_cases.TIME_SETTINGS) + 2 * 4 + 1
    modes = {v["dp_mode"] for v in expected["time"].values() if v["dp"] > 1}
    assert modes == {"ddp", "zero2", "fsdp"}
    assert any(v["pp"] > 1 and v["bubble_ms"] > 0 for v in expected["time"].values())
    assert sum(1 for v in expected["time"].values() if v["correction"] == "gnn") >= len(golden_cases.ZOO_CASES)
    assert len(expected["gnn"]) == 448
