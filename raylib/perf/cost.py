"""What a finished run cost (summary.json `cost`): device-hours, their price, per million tokens,
and the energy bill. Devices are paid for while they are held: the run's wall time, start-up and
checkpoints included, not only its steps.

One definition, shared with `raylib estimate` (perf/estimate.py cost_of): the cost is device-hours x
the price per device-hour, which pays for the device's power (an on-demand cloud price includes
it), and per million tokens is that cost / the tokens trained. The energy and its cost are
reported beside it, not added (that would pay for the power twice)."""

from __future__ import annotations

from typing import Any


def device_price(spec, summary: dict[str, Any]) -> tuple[float | None, str]:
    """(price per device-hour, where it comes from): the JobSpec's, else the catalogue's cloud
    price for the GPU the run's MFU peak was read for; a CPU run has none unless stated."""
    if spec.cost.price_per_device_hour is not None:
        return spec.cost.price_per_device_hour, "cost.price_per_device_hour"
    from raylib.perf.catalogue import CATALOGUE

    source = (summary.get("utilisation") or {}).get("peak_source") or ""
    for row in CATALOGUE:
        if source.startswith("catalogue:") and row.name in source and row.price_per_hour_usd is not None:
            return row.price_per_hour_usd, f"catalogue: {row.name} cloud on-demand"
    return None, "none stated (set cost.price_per_device_hour)"


def predicted_prices(cost, cluster) -> tuple[float | None, str, float]:
    """(price per device-hour, where it comes from, price per kWh) for pricing a prediction on
    `cluster`: what the JobSpec's `cost` section states (the price its finished run is charged at),
    else the cluster file's, else the catalogue's cloud price for the cluster's accelerator (none
    where the devices are a host's own cores, as for a finished CPU run)."""
    stated = cost.model_fields_set if cost is not None else set()
    kwh = cost.price_per_kwh if "price_per_kwh" in stated else cluster.price_per_kwh
    if "price_per_device_hour" in stated and cost.price_per_device_hour is not None:
        return cost.price_per_device_hour, "cost.price_per_device_hour", kwh
    if cluster.price_per_device_hour is not None:
        return cluster.price_per_device_hour, "the cluster's price_per_device_hour", kwh
    # where the devices are a host's cores (this machine), the catalogue's price is a whole node's
    if cluster.host_cores_per_node is None and cluster.row.price_per_hour_usd is not None:
        return cluster.row.price_per_hour_usd, f"catalogue: {cluster.row.name} cloud on-demand", kwh
    return None, "none stated (set cost.price_per_device_hour)", kwh


def run_devices(summary: dict[str, Any]) -> float:
    """The devices a run held over its wall time. An elastic run that resized held each fit's
    workers for that fit: the wall time is shared out over the fits by their training loops' time
    (the start-up and resize gaps between fits are not timed per fit)."""
    fits = [g for g in summary.get("segments") or [] if g.get("workers") and g.get("loop_s")]
    if len(fits) < 2 or len(fits) != len(summary["segments"]):
        return summary["world_size"]
    return sum(g["workers"] * g["loop_s"] for g in fits) / sum(g["loop_s"] for g in fits)


def run_cost(spec, summary: dict[str, Any]) -> dict[str, Any]:
    devices = run_devices(summary)
    device_hours = devices * summary["wall_s"] / 3600
    steps_run = summary["steps"] - summary["start_step"]
    tokens = steps_run * summary["global_batch_size"] * summary["seq_len"]
    price, source = device_price(spec, summary)
    cost = device_hours * price if price is not None else None
    energy = ((summary.get("telemetry") or {}).get("energy") or {})
    kwh = energy.get("facility_kwh", energy.get("kwh"))
    energy_cost = kwh * spec.cost.price_per_kwh if kwh is not None else None
    return {
        "currency": spec.cost.currency, "devices": devices, "device_hours": device_hours,
        "price_per_device_hour": price,
        "price_source": source, "device_cost": cost, "energy_kwh": kwh,
        "energy_basis": ("facility (x PUE)" if "facility_kwh" in energy else "IT (no telemetry.pue)")
        if kwh is not None else None,
        "energy_estimate": energy.get("estimate"), "price_per_kwh": spec.cost.price_per_kwh,
        "energy_cost": energy_cost, "total": cost,
        "per_million_tokens": cost / tokens * 1e6 if cost is not None and tokens else None,
    }
