"""raylib.perf.tco: the cost arithmetic against hand calculations, break-even, the brief's example,
validation messages, the plot and the `raylib tco` command."""

from __future__ import annotations

import argparse
import json

import pytest
from pydantic import ValidationError

from raylib.perf import tco
from raylib.perf.tco import TcoSpec

pytestmark = pytest.mark.unit

# Small numbers so every expected value below is worked out by hand from the formulas.
SMALL = dict(devices=2, device_capex=1000, network_capex_fraction=0.1, network_capex=0, installation=100,
             depreciation_years=4, device_power_w=500, idle_power_fraction=0, utilisation=0.5, pue=1.5,
             electricity_price_per_kwh=0.2, cooling_per_year=10, space_per_device_year=20,
             maintenance_fraction_per_year=0.05, staff_per_year=30, years=2, cloud_price_per_device_hour=1.0)


def test_onprem_arithmetic_by_hand():
    b = tco.onprem_cost(TcoSpec(**SMALL))
    # capex: 2 × 1000 × 1.1 + 100; the horizon (2 y) is inside the hardware's life (4 y): paid once
    assert b.capex == pytest.approx(2300)
    # IT energy: 2 × 0.5 kW × 8760 h × 0.5 = 4380 kWh/y; × 0.2 = 876/y; 2 years
    assert b.power == pytest.approx(1752)
    # PUE overhead 0.5 × 876 = 438/y, + 10/y non-energy cooling; 2 years
    assert b.cooling == pytest.approx(896)
    assert b.space == pytest.approx(80)  # 2 devices × 20 × 2 y
    assert b.maintenance == pytest.approx(220)  # 5% of 2200 hardware (no installation) × 2 y
    assert b.staff == pytest.approx(60)
    assert b.total == pytest.approx(5308)
    assert b.per_year()["total"] == pytest.approx(2654)
    # beyond the hardware's life its refresh is straight-line: 2300 × 6 / 4
    assert tco.onprem_cost(TcoSpec(**SMALL), years=6).capex == pytest.approx(3450)


def test_cloud_arithmetic_by_hand():
    c = tco.cloud_cost(TcoSpec(**SMALL))
    assert c.billing == "device-hour"
    assert c.device_hours == pytest.approx(17520)  # 2 × 8760 × 0.5 × 2
    assert c.total == pytest.approx(17520)  # × 1.0 per device-hour
    # per token: 17520 device-h × 1000 tokens = 17.52e6 tokens × 500 per million
    per_token = TcoSpec(**SMALL, cloud_price_per_million_tokens=500, tokens_per_device_hour=1000)
    c = tco.cloud_cost(per_token)
    assert (c.billing, c.tokens, c.total) == ("token", pytest.approx(17.52e6), pytest.approx(8760))


def test_break_even_by_hand():
    be = tco.break_even(TcoSpec(**SMALL))
    # a = 2300 + 2 × (10 + 40 + 110 + 30) = 2680; b = 2 × 876 × 1.5 × 2 = 5256 (energy at u=1);
    # c = 2 × 2 × 8760 × 1.0 = 35040; u* = a / (c - b)
    assert be.utilisation == pytest.approx(2680 / 29784)
    # years at u=0.5: capex 2300 / (cloud 8760 - opex (876 + 448 + 40 + 110 + 30)) per year
    assert be.years == pytest.approx(2300 / 7256)
    assert be.tokens_per_year is None  # no throughput given


@pytest.mark.parametrize("spec", [TcoSpec(**SMALL), TcoSpec(), TcoSpec(idle_power_fraction=0.3),
                                  tco.brief_per_token_example()])
def test_break_even_utilisation_is_where_costs_cross(spec):
    u = tco.break_even(spec).utilisation
    assert u is not None and 0 < u < 1
    at = spec.model_copy(update={"utilisation": u})
    onprem, cloud = tco.onprem_cost(at).total, tco.cloud_cost(at).total
    assert onprem == pytest.approx(cloud, rel=1e-6)
    assert tco.break_even(at).years == pytest.approx(spec.years, rel=1e-6)  # the same point in time
    above = spec.model_copy(update={"utilisation": u * 1.01})
    assert tco.onprem_cost(above).total < tco.cloud_cost(above).total
    below = spec.model_copy(update={"utilisation": u * 0.99})
    assert tco.onprem_cost(below).total > tco.cloud_cost(below).total


def test_break_even_years_is_where_cumulative_costs_cross():
    spec = TcoSpec()
    t = tco.break_even(spec).years
    assert t is not None and 0 < t < spec.depreciation_years
    assert tco.onprem_cost(spec, t).total == pytest.approx(tco.cloud_cost(spec, t).total, rel=1e-9)
    assert tco.onprem_cost(spec, t * 1.01).total < tco.cloud_cost(spec, t * 1.01).total


def test_never_breaks_even():
    cheap_cloud = TcoSpec(cloud_price_per_device_hour=0.1)
    be = tco.break_even(cheap_cloud)
    assert be.utilisation is None and be.years is None
    assert tco.compare(cheap_cloud).cheaper == "cloud"
    # saving per year exists but repays the capex only after the hardware is written off: never
    slow = TcoSpec(**{**SMALL, "device_capex": 100_000})
    assert tco.break_even(slow).years is None


def test_brief_per_token_example():
    spec = tco.brief_per_token_example()
    assert spec.currency == "RMB" and spec.years == 5
    r = tco.compare(spec, tco.BRIEF_NOTES)
    # the brief: 125 billion tokens over five years through a per-token API ≈ 1 million RMB
    assert r.cloud.tokens == pytest.approx(125e9)
    assert r.cloud.total == pytest.approx(125e9 / 1e6 * spec.cloud_price_per_million_tokens, rel=1e-12)
    assert r.cloud.total == pytest.approx(1e6, rel=0.05)  # the brief's round figure
    # on-prem needs millions up front ...
    assert r.onprem.capex >= 2e6
    # ... so at the brief's load the cloud is cheaper over five years ...
    assert r.cheaper == "cloud"
    # ... and on-prem is cheaper above a sustained-load threshold, which is more than the brief's load
    threshold = r.break_even.tokens_per_year
    assert threshold is not None and threshold > 125e9 / 5
    above = spec.model_copy(update={"utilisation": r.break_even.utilisation * 1.05})
    assert tco.compare(above).cheaper == "on-prem"
    assert any("8 RMB per million" in a for a in r.assumptions)
    assert any("tokens/s" in a for a in r.assumptions)  # the throughput the threshold rests on


@pytest.mark.parametrize(("field", "value", "hint"), [
    ("utilisation", 1.5, "in [0, 1]"),
    ("devices", 0, ">= 1"),
    ("electricity_price_per_kwh", -0.1, ">= 0"),
    ("cloud_price_per_device_hour", -1, ">= 0"),
    ("pue", 0.9, ">= 1"),
    ("years", 0, "> 0"),
    ("electricity_price_per_kwh", float("nan"), ">= 0"),
])
def test_bad_input_names_the_field_and_the_fix(field, value, hint):
    with pytest.raises(ValueError) as e:
        TcoSpec.from_dict({field: value})
    msg = str(e.value)
    assert f"- {field}:" in msg and hint in msg and repr(value) in msg
    with pytest.raises(ValidationError, match=field):  # the plain constructor names it too
        TcoSpec(**{field: value})


def test_other_bad_input():
    with pytest.raises(ValueError, match="devicez: unknown field; allowed: currency, devices"):
        TcoSpec.from_dict({"devicez": 8})
    with pytest.raises(ValueError, match="tokens_per_device_hour: required"):
        TcoSpec.from_dict({"cloud_price_per_million_tokens": 8})


def test_plot_writes_a_png(tmp_path):
    specs = [TcoSpec(), tco.brief_per_token_example(), TcoSpec(cloud_price_per_device_hour=0)]
    for i, spec in enumerate(specs):
        out = tco.plot(spec, tmp_path / f"tco{i}.png")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli(argv):
    p = argparse.ArgumentParser(prog="raylib tco")
    tco.add_arguments(p)
    return tco.main(p.parse_args(argv))


def test_cli_json(capsys, tmp_path):
    cfg = tmp_path / "tco.yaml"
    cfg.write_text("devices: 2\ndevice_capex: 1000\nyears: 2\n")
    png = tmp_path / "out.png"
    assert _cli(["--config", str(cfg), "--set", "utilisation=0.5", "--json", "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["spec"]["devices"] == 2 and data["spec"]["utilisation"] == 0.5
    assert data["cloud"]["device_hours"] == pytest.approx(2 * 8760 * 0.5 * 2)
    assert set(data) >= {"onprem", "cloud", "break_even", "assumptions", "cheaper"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_table_and_example(capsys):
    assert _cli(["--example", "brief"]) == 0
    out = capsys.readouterr().out
    assert "RMB" in out and "1,000,000" in out and "break-even utilisation" in out and "assumptions:" in out
    assert _cli(["--example", "brief", "--set", "utilisation=0.9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cheaper"] == "on-prem"


def test_cli_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="utilisation"):
        _cli(["--set", "utilisation=2"])
    with pytest.raises(ValueError, match="key=value"):
        _cli(["--set", "utilisation"])
    with pytest.raises(ValueError, match="not found"):
        _cli(["--config", str(tmp_path / "missing.yaml")])


def test_cli_takes_capex_and_cloud_price_from_the_catalogue(capsys):
    from raylib.perf.catalogue import accelerator

    a100 = accelerator("a100")
    assert _cli(["--accelerator", "a100", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert spec["device_capex"] == a100.capex_usd
    assert spec["cloud_price_per_device_hour"] == a100.price_per_hour_usd
    with pytest.raises(ValueError, match="no device_capex for Google TPU v4"):
        _cli(["--accelerator", "asic"])
    with pytest.raises(ValueError, match="tpu9"):
        _cli(["--accelerator", "tpu9"])


def test_cli_takes_the_accelerators_power_from_the_catalogue_not_the_h100_default(capsys):
    """--accelerator v100 is billed a DGX-1's power share (3,500 W / 8), not the default's DGX H100
    share; a device without a published system figure is billed its TDP, and --set still wins."""
    from raylib.perf.catalogue import accelerator

    def spec_and_notes(*args):
        assert _cli([*args, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["spec"], " ".join(out["assumptions"])

    v100, notes = spec_and_notes("--accelerator", "v100")
    assert v100["device_power_w"] == pytest.approx(3500 / 8) != TcoSpec().device_power_w
    assert "437.5 W" in notes and "server share included" in notes
    cpu, notes = spec_and_notes("--accelerator", "cpu")
    assert cpu["device_power_w"] == accelerator("cpu").tdp_w and "TDP" in notes
    stated, _ = spec_and_notes("--accelerator", "v100", "--set", "device_power_w=500")
    assert stated["device_power_w"] == 500
