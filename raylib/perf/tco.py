"""Total cost of ownership: on-prem accelerators against cloud, per device-hour or per token.

    on-prem(t) = capex × max(1, t / depreciation_years)            cash up front, then refresh
               + t × (power + cooling + space + maintenance + staff)  per year, at `utilisation`
    cloud(t)   = t × devices × 8760 h × utilisation × price_per_device_hour
               or t × (those device-hours × tokens_per_device_hour) × price_per_million_tokens / 1e6

Both are linear in utilisation, so the break-even utilisation and the years to break even have
closed forms. Every price is an input with a documented default and its source: defaults are a
starting point to be replaced by quotes, not truths. `brief_per_token_example()` reproduces the
brief's figure (125 billion tokens over five years through a per-token API ≈ 1 million RMB) and
states each assumption the comparison needs.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CATALOGUE_CURRENCY = "USD"  # raylib/perf/catalogue.py's prices (price_per_hour_usd, capex_usd)
HOURS_PER_YEAR = 8760.0  # 365 days; leap days are below the precision of any price here


class TcoSpec(BaseModel):
    """What a TCO comparison needs. Defaults (USD): one 8-GPU H100-class server against an on-demand
    GPU cloud, around 2024-25; each default's comment gives its source or says it is an assumption."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    currency: str = Field("USD", min_length=1, description="a currency label for the output, e.g. USD, RMB")
    devices: int = Field(8, ge=1, description="accelerators owned on-prem (and rented in the cloud), >= 1")
    # ~USD 280k for an 8×H100 HGX server (public reseller quotes and SemiAnalysis' H100 cluster cost
    # breakdowns put it at 250-300k): 35k per GPU with its share of CPUs, memory, NICs, chassis.
    device_capex: float = Field(35_000.0, ge=0, description="purchase price per device incl. its share of "
                                "the server, >= 0")
    # InfiniBand/RoCE switches, optics and cables are commonly 10-20% of a GPU cluster's hardware
    # (SemiAnalysis, NVIDIA reference architectures); assumption: 15%.
    network_capex_fraction: float = Field(0.15, ge=0, description="network capex as a fraction of the "
                                          "devices' capex, >= 0 (0.15 = 15%)")
    network_capex: float = Field(0.0, ge=0, description="network capex as an absolute amount, added to the "
                                 "fraction, >= 0")
    # Assumption: racking, cabling, power distribution and commissioning of one rack.
    installation: float = Field(10_000.0, ge=0, description="one-off installation cost, >= 0")
    # Straight-line over 5 years: the life most hyperscalers now book servers over (5-6 years).
    depreciation_years: float = Field(5.0, gt=0, description="hardware life in years, > 0; after it the "
                                      "hardware's refresh is charged at capex / depreciation_years per year")
    # NVIDIA DGX H100 datasheet: ~10.2 kW max for 8 GPUs, i.e. ~1275 W per GPU with its server share
    # (the GPU alone is 700 W TDP; the brief quotes ~800 W for a GPU).
    device_power_w: float = Field(1275.0, ge=0, description="power per device at full load in watts, incl. "
                                  "its server share, >= 0")
    # 0 follows the brief's formula (TDP × utilisation): idle nodes powered down. A server left on idle
    # draws roughly 20-35% of its peak; set that here to charge it.
    idle_power_fraction: float = Field(0.0, ge=0, le=1, description="power drawn while idle as a fraction "
                                       "of device_power_w, in [0, 1]")
    # Assumption: a well-fed training cluster; the brief's BERT case ran below 40% before its fixes.
    utilisation: float = Field(0.7, ge=0, le=1, description="sustained load: the fraction of the year the "
                               "devices do useful work, in [0, 1] (0.7 = 70%)")
    # Uptime Institute Global Data Center Survey 2024: average annual PUE ~1.56.
    pue: float = Field(1.56, ge=1, description="power usage effectiveness, facility energy / IT energy, "
                       ">= 1 (1.0 = no overhead)")
    # US EIA Electric Power Monthly, 2024: industrial ~0.08, commercial ~0.13 USD/kWh; assumption 0.10.
    electricity_price_per_kwh: float = Field(0.10, ge=0, description="electricity price per kWh, >= 0")
    # Cooling *energy* is the PUE overhead (PUE - 1) × IT energy and is reported as `cooling`; this
    # field is only cooling's non-energy cost (chiller/CDU service, coolant) so nothing is counted twice.
    cooling_per_year: float = Field(0.0, ge=0, description="non-energy cooling cost per year (cooling energy "
                                    "is in pue), >= 0")
    # Assumption: ~USD 1,000/month for a high-density rack of 8 GPUs (space only; power is separate).
    space_per_device_year: float = Field(1_500.0, ge=0, description="floor/rack space per device per year, "
                                         ">= 0")
    # Vendor support contracts run ~8-15% of the hardware price per year; assumption 10%.
    maintenance_fraction_per_year: float = Field(0.10, ge=0, le=1, description="maintenance/support per "
                                                 "year as a fraction of hardware capex, in [0, 1]")
    # Assumption: 0.1 FTE of an operations engineer at ~USD 150k fully loaded.
    staff_per_year: float = Field(15_000.0, ge=0, description="operations staff cost per year, >= 0")
    years: float = Field(5.0, gt=0, description="comparison horizon in years, > 0")
    # On-demand H100 at GPU clouds, 2024-25: ~2-3.5 USD/GPU-h (e.g. Lambda's list price 2.99);
    # hyperscalers list more (AWS p5 ~7 USD/GPU-h after its 2025 cut). Assumption: 3.0.
    cloud_price_per_device_hour: float = Field(3.0, ge=0, description="cloud price per device-hour, >= 0")
    # Per-token billing instead (set both): an API's price per million tokens, and what one of the
    # on-prem devices serves or trains per hour at full load (so the same work is priced both ways).
    cloud_price_per_million_tokens: float | None = Field(None, ge=0, description="cloud price per million "
                                                         "tokens, >= 0; when set, the cloud is billed per "
                                                         "token (set tokens_per_device_hour too)")
    tokens_per_device_hour: float | None = Field(None, gt=0, description="tokens one device processes per "
                                                 "hour at full load, > 0")

    @model_validator(mode="after")
    def _per_token_needs_throughput(self) -> TcoSpec:
        if self.cloud_price_per_million_tokens is not None and self.tokens_per_device_hour is None:
            raise ValueError("tokens_per_device_hour: required when cloud_price_per_million_tokens is set "
                             "(the tokens the on-prem devices would process); set it, e.g. "
                             "tokens_per_device_hour=2e6, or unset the per-token price")
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "tco") -> TcoSpec:
        """Validate `data`; a ValueError names each bad field, what was given and what is expected."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as e:
            raise ValueError(_explain(e, source)) from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Sequence[str] = ()) -> TcoSpec:
        from raylib.fileio import load_yaml_mapping

        data = load_yaml_mapping(path, "TCO config file")
        return cls.from_dict(_apply_overrides(data, overrides), source=str(path))

    @property
    def per_token(self) -> bool:
        return self.cloud_price_per_million_tokens is not None

    @property
    def capex(self) -> float:
        return self.hardware_capex + self.installation

    @property
    def hardware_capex(self) -> float:
        """Devices and network: what maintenance contracts are priced on (not installation)."""
        return self.devices * self.device_capex * (1 + self.network_capex_fraction) + self.network_capex


def _explain(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid TCO spec ({e.error_count()} problem(s)):"]
    for err in e.errors():
        name = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {name}: unknown field; allowed: {', '.join(TcoSpec.model_fields)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        f = TcoSpec.model_fields.get(name)
        fix = f"; expected: {f.description}" if f is not None and f.description else ""
        got = f" (got {err.get('input')!r})" if name else ""
        lines.append(f"  - {name or '(spec)'}: {msg}{got}{fix}")
    return "\n".join(lines)


def _apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    from raylib.fileio import parse_yaml

    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected key=value, e.g. utilisation=0.5")
        data[key.strip()] = parse_yaml(raw)  # 0.5 and 1e9 are floats
    return data


def _spec(spec: TcoSpec | Mapping[str, Any]) -> TcoSpec:
    return spec if isinstance(spec, TcoSpec) else TcoSpec.from_dict(spec)


# -- the cost model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breakdown:
    """On-prem cost over `years`; `per_year()` divides each part by the horizon."""

    years: float
    capex: float  # hardware + network + installation, incl. refresh beyond depreciation_years
    power: float  # IT energy
    cooling: float  # the PUE overhead's energy + non-energy cooling cost
    space: float
    maintenance: float
    staff: float

    @property
    def total(self) -> float:
        return self.capex + self.power + self.cooling + self.space + self.maintenance + self.staff

    def per_year(self) -> dict[str, float]:
        return {k: v / self.years for k, v in self.to_dict().items() if k != "years"}

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class CloudCost:
    years: float
    billing: str  # "device-hour" or "token"
    device_hours: float
    tokens: float | None  # per-token billing, or when throughput is known
    total: float

    def per_year(self) -> float:
        return self.total / self.years

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _energy_kwh_per_year(s: TcoSpec, u: float) -> float:
    """IT energy: devices × power × (idle share + load share × utilisation) × 8760 h."""
    load = s.idle_power_fraction + (1 - s.idle_power_fraction) * u
    return s.devices * s.device_power_w / 1000 * HOURS_PER_YEAR * load


def _onprem_opex_per_year(s: TcoSpec, u: float) -> float:
    kwh = _energy_kwh_per_year(s, u)
    return (kwh * s.pue * s.electricity_price_per_kwh + s.cooling_per_year
            + s.devices * s.space_per_device_year
            + s.maintenance_fraction_per_year * s.hardware_capex + s.staff_per_year)


def _cloud_per_year(s: TcoSpec, u: float) -> float:
    hours = s.devices * HOURS_PER_YEAR * u
    if s.per_token:
        return hours * s.tokens_per_device_hour * s.cloud_price_per_million_tokens / 1e6
    return hours * s.cloud_price_per_device_hour


def _capex_by(s: TcoSpec, years: float) -> float:
    """Cash up front; once written off, the hardware's refresh is charged straight-line."""
    return s.capex * max(1.0, years / s.depreciation_years)


def onprem_cost(spec: TcoSpec | Mapping[str, Any], years: float | None = None) -> Breakdown:
    s = _spec(spec)
    t = s.years if years is None else years
    kwh = _energy_kwh_per_year(s, s.utilisation)
    price = s.electricity_price_per_kwh
    return Breakdown(
        years=t, capex=_capex_by(s, t), power=t * kwh * price,
        cooling=t * (kwh * (s.pue - 1) * price + s.cooling_per_year),
        space=t * s.devices * s.space_per_device_year,
        maintenance=t * s.maintenance_fraction_per_year * s.hardware_capex, staff=t * s.staff_per_year)


def cloud_cost(spec: TcoSpec | Mapping[str, Any], years: float | None = None) -> CloudCost:
    """The cloud doing the on-prem devices' work: the same device-hours (or the tokens they process)."""
    s = _spec(spec)
    t = s.years if years is None else years
    hours = s.devices * HOURS_PER_YEAR * s.utilisation * t
    tokens = hours * s.tokens_per_device_hour if s.tokens_per_device_hour is not None else None
    return CloudCost(years=t, billing="token" if s.per_token else "device-hour", device_hours=hours,
                     tokens=tokens, total=t * _cloud_per_year(s, s.utilisation))


@dataclass(frozen=True)
class BreakEven:
    utilisation: float | None  # on-prem is cheaper over the horizon above it; None: not at any load <= 1
    years: float | None  # at the spec's utilisation; None: never (cloud's saving never repays capex)
    tokens_per_year: float | None  # the break-even utilisation as a load, when throughput is known

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def break_even(spec: TcoSpec | Mapping[str, Any]) -> BreakEven:
    s = _spec(spec)
    # Over the horizon both costs are linear in u: on-prem = a + b·u, cloud = c·u.
    opex0, opex1 = _onprem_opex_per_year(s, 0.0), _onprem_opex_per_year(s, 1.0)
    a = _capex_by(s, s.years) + s.years * opex0
    b = s.years * (opex1 - opex0)
    c = s.years * _cloud_per_year(s, 1.0)
    u_star = a / (c - b) if c > b else math.inf
    u = u_star if u_star <= 1 else None
    # In time at the spec's load: capex = t × (cloud - opex) per year, which must happen before the
    # hardware is written off, since afterwards on-prem's refresh charge outgrows cloud's saving.
    saving = _cloud_per_year(s, s.utilisation) - _onprem_opex_per_year(s, s.utilisation)
    t = s.capex / saving if saving > 0 else math.inf
    tokens = (u * s.devices * HOURS_PER_YEAR * s.tokens_per_device_hour
              if u is not None and s.tokens_per_device_hour is not None else None)
    in_life = t <= s.depreciation_years * (1 + 1e-9)  # at exactly the life's end, not lost to rounding
    return BreakEven(utilisation=u, years=t if in_life else None, tokens_per_year=tokens)


@dataclass(frozen=True)
class Comparison:
    spec: TcoSpec
    onprem: Breakdown
    cloud: CloudCost
    break_even: BreakEven
    assumptions: list[str] = field(default_factory=list)

    @property
    def cheaper(self) -> str:
        return "on-prem" if self.onprem.total < self.cloud.total else "cloud"

    @property
    def saving(self) -> float:
        """What the cheaper option saves over the horizon."""
        return abs(self.cloud.total - self.onprem.total)

    def to_dict(self) -> dict[str, Any]:
        return {"currency": self.spec.currency, "years": self.spec.years, "spec": self.spec.model_dump(),
                "onprem": self.onprem.to_dict(), "onprem_per_year": self.onprem.per_year(),
                "cloud": self.cloud.to_dict(), "break_even": self.break_even.to_dict(),
                "cheaper": self.cheaper, "saving": self.saving, "assumptions": list(self.assumptions)}


def assumptions(spec: TcoSpec) -> list[str]:
    s = spec
    out = [
        f"on-prem capex {s.capex:,.0f} {s.currency} is paid up front; beyond {s.depreciation_years:g} years "
        "its refresh is charged straight-line (capex / depreciation_years per year); no resale value",
        f"power = {s.devices} devices × {s.device_power_w:g} W × (idle {s.idle_power_fraction:g} + "
        f"(1 - {s.idle_power_fraction:g}) × utilisation {s.utilisation:.3g}) × 8760 h/year × electricity "
        f"{s.electricity_price_per_kwh:g}"
        f" {s.currency}/kWh; cooling energy is the PUE overhead ({s.pue:g} - 1), not counted again",
        f"maintenance {s.maintenance_fraction_per_year:.0%} of hardware capex per year, staff "
        f"{s.staff_per_year:,.0f} and space {s.space_per_device_year:,.0f}/device {s.currency} per year",
    ]
    if s.per_token:
        out.append(f"cloud billed per token at {s.cloud_price_per_million_tokens:g} {s.currency}/million "
                   f"for the tokens the on-prem devices would process ({s.tokens_per_device_hour:,.0f} "
                   "tokens per device-hour at full load × device-hours used)")
    else:
        out.append(f"cloud billed {s.cloud_price_per_device_hour:g} {s.currency}/device-hour for the device-"
                   "hours used (devices × 8760 × utilisation × years); a cloud device is as fast as an "
                   "on-prem one")
    out.append("no discounting (cost of capital), no price changes over the horizon; the cloud price is "
               "all-in (no egress, storage or support added); prices are inputs, not truths")
    return out


def compare(spec: TcoSpec | Mapping[str, Any], notes: Sequence[str] = ()) -> Comparison:
    """Everything at once; `notes` are extra assumptions to carry (e.g. where the inputs came from)."""
    s = _spec(spec)
    return Comparison(spec=s, onprem=onprem_cost(s), cloud=cloud_cost(s), break_even=break_even(s),
                      assumptions=[*assumptions(s), *notes])


# -- the brief's example -------------------------------------------------------------------------

BRIEF_TOKENS = 125e9  # over five years, through a per-token cloud API ≈ 1 million RMB
BRIEF_YEARS = 5.0
BRIEF_PRICE_PER_MILLION = 8.0  # RMB: 1e6 RMB / (125e9 / 1e6) tokens
BRIEF_APPLIANCE_TOKENS_PER_S = 5_000.0  # assumption: the whole 8-accelerator appliance, batched
BRIEF_DEVICES = 8

BRIEF_NOTES = [
    "brief: 125e9 tokens over 5 years through a per-token API ≈ 1,000,000 RMB implies 8 RMB per million "
    "tokens (DeepSeek-V3's listed 2025 price for output tokens was 8 RMB/million; input was 2)",
    "appliance: an all-in-one box of 8 accelerators at 2,000,000 RMB (vendors' 2025 DeepSeek appliances "
    "were quoted at 1-3 million RMB), 50,000 RMB installation, no separate network",
    f"appliance throughput {BRIEF_APPLIANCE_TOKENS_PER_S:,.0f} tokens/s at full load (assumption: batched "
    "serving; it depends on model, hardware and sequence lengths: measure yours), so the brief's load "
    "(25e9 tokens/year) is the appliance's utilisation",
    "appliance power 10 kW at full load, 30% of it drawn while idle (left on 24/7); electricity 0.8 "
    "RMB/kWh (Chinese industrial/commercial tariffs run ~0.6-1.0); PUE 1.5 (an enterprise machine room)",
    "maintenance 5% of capex per year, 0.25 of a 200,000 RMB/year engineer, 2,000 RMB/device-year space",
]


def brief_per_token_example() -> TcoSpec:
    """The brief's per-token example in RMB (assumptions in BRIEF_NOTES): the load is 125e9 tokens over
    5 years, expressed as the appliance's utilisation at its assumed throughput."""
    per_device_hour = BRIEF_APPLIANCE_TOKENS_PER_S * 3600 / BRIEF_DEVICES
    load = BRIEF_TOKENS / (BRIEF_YEARS * BRIEF_DEVICES * HOURS_PER_YEAR * per_device_hour)
    return TcoSpec(
        currency="RMB", devices=BRIEF_DEVICES, device_capex=2_000_000 / BRIEF_DEVICES,
        network_capex_fraction=0.0, installation=50_000, depreciation_years=5,
        device_power_w=10_000 / BRIEF_DEVICES, idle_power_fraction=0.3,
        utilisation=load, pue=1.5, electricity_price_per_kwh=0.8, space_per_device_year=2_000,
        maintenance_fraction_per_year=0.05, staff_per_year=50_000, years=BRIEF_YEARS,
        cloud_price_per_million_tokens=BRIEF_PRICE_PER_MILLION, tokens_per_device_hour=per_device_hour)


# -- the plot ------------------------------------------------------------------------------------


def plot(spec: TcoSpec | Mapping[str, Any], path: str | Path) -> Path:
    """A PNG: cumulative cost against years (break-even marked) and cost against utilisation over the
    horizon (break-even utilisation marked)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = _spec(spec)
    be = break_even(s)
    horizon = max(s.years, 1.25 * be.years) if be.years is not None else s.years
    ts = [horizon * i / 200 for i in range(201)]
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)  # the Agg canvas, whatever pyplot's backend is
    ax, ax2 = fig.subplots(1, 2)
    ax.plot(ts, [onprem_cost(s, t).total for t in ts], label="on-prem")
    ax.plot(ts, [cloud_cost(s, t).total for t in ts], label=f"cloud (per {cloud_cost(s).billing})")
    if be.years is not None:
        y = cloud_cost(s, be.years).total
        ax.axvline(be.years, color="grey", ls=":")
        ax.plot([be.years], [y], "ko")
        ax.annotate(f"break-even {be.years:.2f} y", (be.years, y), textcoords="offset points",
                    xytext=(6, -12))
    ax.set(xlabel="years", ylabel=f"cumulative cost ({s.currency})",
           title=f"{s.devices} devices at {s.utilisation:.0%} utilisation")
    ax.legend()
    us = [i / 100 for i in range(101)]
    ax2.plot(us, [onprem_cost(s.model_copy(update={"utilisation": u})).total for u in us], label="on-prem")
    ax2.plot(us, [cloud_cost(s.model_copy(update={"utilisation": u})).total for u in us], label="cloud")
    if be.utilisation is not None:
        ax2.axvline(be.utilisation, color="grey", ls=":")
        ax2.annotate(f"break-even {be.utilisation:.1%}", (be.utilisation, 0), textcoords="offset points",
                     xytext=(4, 8))
    ax2.axvline(s.utilisation, color="C2", ls="--", label="this load")
    ax2.set(xlabel="utilisation", ylabel=f"cost over {s.years:g} years ({s.currency})",
            title="cost against sustained load")
    ax2.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png", dpi=100)
    return path


# -- `raylib tco` --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML of TcoSpec fields (devices, device_capex, "
                   "utilisation, pue, cloud_price_per_device_hour ...); unset fields take the defaults")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. utilisation=0.5 (repeatable)")
    p.add_argument("--example", choices=["brief"], help="start from the brief's per-token example "
                   "(125e9 tokens over 5 years, RMB)")
    p.add_argument("--accelerator", metavar="KEY", help="take device_capex and the cloud price per "
                   "device-hour from the accelerator catalogue (raylib/perf/catalogue.py: a100, h100 ...)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of cost against years and utilisation")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")


def main(args: argparse.Namespace) -> int:
    """`raylib tco`: 0 with the comparison printed; bad input raises ValueError naming the field."""
    data: dict[str, Any] = {}
    notes: list[str] = []
    source = "tco"
    if args.example == "brief":
        data = brief_per_token_example().model_dump(exclude_defaults=True)
        notes = list(BRIEF_NOTES)
    catalogue: dict[str, float | None] = {}
    if getattr(args, "accelerator", None):  # the catalogue's figures, under any file or --set
        from raylib.perf.catalogue import accelerator

        row = accelerator(args.accelerator)
        catalogue = {"device_capex": row.capex_usd, "cloud_price_per_device_hour": row.price_per_hour_usd}
        data.update({k: v for k, v in catalogue.items() if v is not None})
        # its power too, not the default's H100-class server: the system figure, else the device's TDP
        power = row.system_power_w if row.system_power_w is not None else row.tdp_w
        data["device_power_w"] = power
    user: dict[str, Any] = {}
    if args.config:
        from raylib.fileio import load_yaml_mapping

        user = load_yaml_mapping(args.config, "TCO config file")
        source = args.config
    user = _apply_overrides(user, args.overrides)
    spec = TcoSpec.from_dict({**data, **user}, source=source)
    if catalogue:  # checked after the file and --set, which may supply what the catalogue lacks
        # per-token billing never reads the cloud's device-hour price
        used = [k for k in catalogue if k not in user
                and not (k == "cloud_price_per_device_hour" and spec.per_token)]
        for k in used:
            if catalogue[k] is None:
                raise ValueError(f"--accelerator {args.accelerator}: the catalogue has no {k} for "
                                 f"{row.name}; give it with --set {k}=...")
        if used and spec.currency != CATALOGUE_CURRENCY:
            raise ValueError(f"--accelerator {args.accelerator}: the catalogue's prices are "
                             f"{CATALOGUE_CURRENCY} but currency is {spec.currency}; give them in "
                             f"{spec.currency} with " + " ".join(f"--set {k}=..." for k in used)
                             + f", or set currency={CATALOGUE_CURRENCY}")
        if used:
            notes.append(f"{' and '.join(used)}: the catalogue's {row.name} row (sources there)")
        if "device_power_w" not in user:
            notes.append(f"device_power_w {power:g} W: the catalogue's {row.name} "
                         + ("system power per device, its server share included" if row.system_power_w
                            is not None else "TDP (no server share published: set device_power_w to add it)"))
    result = compare(spec, notes)
    if args.plot:
        plot(spec, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result))
    if args.plot and not args.json:
        print(f"plot: {args.plot}")
    return 0


def format_table(r: Comparison) -> str:
    s, o, c, be = r.spec, r.onprem, r.cloud, r.break_even
    cur = s.currency
    rows = [(k, getattr(o, k)) for k in ("capex", "power", "cooling", "space", "maintenance", "staff")]
    # columns as wide as the largest figure (big fleets over long horizons), 16 at least
    w = max(16, *(len(f"{v:,.0f}") + 2 for v in [*(v for _, v in rows), o.total, c.total]))
    lines = [f"TCO over {s.years:g} years ({cur}): {s.devices} devices at {s.utilisation:.1%} utilisation",
             f"  {'':<14}{'on-prem':>{w}}{'cloud':>{w}}"]
    lines += [f"  {k:<14}{v:>{w},.0f}" for k, v in rows]
    usage = f"{c.tokens:,.3g} tokens" if c.billing == "token" else f"{c.device_hours:,.0f} device-h"
    lines.append(f"  {'cloud':<14}{'':>{w}}{c.total:>{w},.0f}   ({usage}, per {c.billing})")
    lines.append(f"  {'total':<14}{o.total:>{w},.0f}{c.total:>{w},.0f}")
    lines.append(f"cheaper: {r.cheaper}, by {r.saving:,.0f} {cur} over {s.years:g} years")
    if be.utilisation is None:
        lines.append("break-even utilisation: none (cloud is cheaper even at 100% load)")
    else:
        load = f" = {be.tokens_per_year:,.4g} tokens/year" if be.tokens_per_year is not None else ""
        lines.append(f"break-even utilisation: {be.utilisation:.1%}{load} (on-prem cheaper above it)")
    lines.append(f"break-even years at {s.utilisation:.1%}: " + (
        f"{be.years:.2f}" if be.years is not None else "never (cloud's saving never repays the capex "
        "within the hardware's life)"))
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in r.assumptions]
    return "\n".join(lines)
