"""`raylib top`: a live per-node table of what raylib's workers publish (the `ray_raylib_*` gauges
each node's Ray metrics agent serves), read from the nodes' metrics endpoints: no extra agent."""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.request
from typing import Any

_LINE = re.compile(r'^ray_raylib_(\w+)\{(.*)\} (\S+)$')
_TAG = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
COLUMNS = [("node", "node", "{}"), ("run", "run", "{}"), ("rank", "rank", "{}"), ("device", "device", "{}"),
           ("mfu", "MFU", "{:.1%}"), ("samples_per_s", "samples/s", "{:.1f}"),
           ("data_wait_fraction", "data wait", "{:.0%}"), ("gpu_utilization_pct", "GPU %", "{:.0f}"),
           ("gpu_temperature_c", "temp C", "{:.0f}"), ("gpu_power_w", "power W", "{:.0f}"),
           ("gpu_power_limit_w", "limit W", "{:.0f}"), ("cpu_pct", "CPU %", "{:.0f}"),
           ("health_firings", "health", "{:.0f}")]


def parse(text: str) -> list[dict[str, Any]]:
    """Prometheus exposition lines of raylib's gauges -> one row per (run, rank, node, device)."""
    rows: dict[tuple, dict[str, Any]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, tags, value = m.group(1), dict(_TAG.findall(m.group(2))), float(m.group(3))
        key = (tags.get("run", ""), tags.get("rank", ""), tags.get("node", ""), tags.get("device", ""))
        rows.setdefault(key, dict(zip(("run", "rank", "node", "device"), key, strict=True)))[name] = value
    return sorted(rows.values(), key=lambda r: (r["run"], int(r["rank"] or 0), r["device"]))


def snapshot(endpoints: list[str] | None = None) -> list[dict[str, Any]]:
    """Every node's raylib rows (endpoints: http://ip:port; default: the connected cluster's)."""
    if endpoints is None:
        import ray

        endpoints = [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}"
                     for n in ray.nodes() if n.get("Alive")]
    rows = []
    for url in endpoints:
        try:
            rows += parse(urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode())
        except OSError as e:
            rows.append({"node": url, "run": f"unreachable: {e}", "rank": "", "device": ""})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows under a header; "" without rows (main says that no run publishes)."""
    if not rows:
        return ""
    cells = [[h for _, h, _ in COLUMNS]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) not in (None, "") else "" for k, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one table and exit")


def main(args: argparse.Namespace) -> int:
    import ray

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    try:
        while True:
            text = table(snapshot()) or "no raylib run is publishing metrics"
            if args.once:
                print(text)
                return 0
            sys.stdout.write("\x1b[2J\x1b[H" + time.strftime("%H:%M:%S ") + "raylib top (Ctrl-C to quit)\n"
                             + text + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        ray.shutdown()
