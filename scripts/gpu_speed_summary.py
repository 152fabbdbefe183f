#!/usr/bin/env python3
"""summary.json and summary.csv of scripts/gpu_speed.sh (standard library only).

    python3 scripts/gpu_speed_summary.py WORK OUT ELAPSED_S BUDGET_S

WORK holds steps.tsv (name, status, rc, seconds, log) and the benches' init.json / stage.json /
gds.json;
OUT gets summary.json (the GPU, every step, every bench row, and the goals of the issue: the
best variant per case against the same run's baseline) and summary.csv (one row per bench row).
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

GOALS_INIT = {("float32", "Uniform"): 0.9, ("float32", "Normal"): 0.75,
              ("float32", "TruncNormal"): 0.75, ("bfloat16", "Uniform"): 0.85,
              ("float16", "Uniform"): 0.85, ("bfloat16", "Normal"): 0.7}


def load(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def goals(init, stage) -> list:
    out = []
    # diagnostic variants (philoxbits: Philox + stores, not the CPU engine's values) show
    # where the time goes; they never meet a goal
    rows = [r for r in (init or []) if r.get("kind") == "init" and not r.get("diagnostic")
            and r.get("variant") != "philoxbits"]
    for (dt, dist), goal in GOALS_INIT.items():
        cand = [r for r in rows if r["dtype"] == dt and r["dist"] == dist]
        if not cand:
            continue
        base = next((r for r in cand if r["variant"] == "base"), None)
        best = max(cand, key=lambda r: r["x_fill"])
        out.append({"goal": f"init {dt} {dist} >= {goal}x fill_", "base": base and
                    round(base["x_fill"], 3), "best": round(best["x_fill"], 3),
                    "best_variant": best["variant"], "met": best["x_fill"] >= goal})
    many = [r for r in (init or []) if r.get("kind") == "many"]
    if many:  # the fastest many-table launch against the fastest one-table launch of any
        one = min(r["one_seconds"] for r in many)  # variant (a slow one table flatters)
        best = min(many, key=lambda r: r["many_seconds"])
        base = next((r for r in many if r["variant"] == "base" and r["tiles"] == 1), None)
        out.append({"goal": "10,240 tables <= 1.15x one table", "base": base and
                    round(base["many_over_one"], 3), "best": round(best["many_seconds"] / one, 3),
                    "best_variant": f"{best['variant']} tiles {best['tiles']}",
                    "met": best["many_seconds"] / one <= 1.15})
    if stage:
        rows = stage.get("rows", [])
        staged = next((r for r in rows if r["row"] == "metamat staged fp32"), None)
        if staged:
            out.append({"goal": "staged load >= 0.9x read ceiling (same threads)",
                        "best": round(staged.get("x_read", 0), 3),
                        "met": staged.get("x_read", 0) >= 0.9})
            if "x_h2d" in staged:
                out.append({"goal": "staged load >= 0.8x pinned H2D", "best":
                            round(staged["x_h2d"], 3), "met": staged["x_h2d"] >= 0.8})
        conv = {r.get("convert"): r for r in rows if "fp32 -> bf16" in r["row"]}
        if "host" in conv and "device" in conv:
            out.append({"goal": "fp32 -> bf16: faster of host/device conversion",
                        "host_gbps": round(conv["host"]["gbps"], 2),
                        "device_gbps": round(conv["device"]["gbps"], 2),
                        "best_variant": "device" if conv["device"]["gbps"] >
                        conv["host"]["gbps"] else "host"})
        sw = [r for r in rows if r["row"] == "sweep"]
        if sw:
            best = max(sw, key=lambda r: r["gbps"])
            first = max(sw, key=lambda r: r["first_gbps"])
            out.append({"goal": "ring x threads sweep: best", "best_variant":
                        f"2 x {best['ring_mib']} MiB, {best['threads']} threads",
                        "best": round(best["gbps"], 2), "x_read": round(best["x_read"], 3),
                        "best_first_call": f"2 x {first['ring_mib']} MiB, {first['threads']} "
                        f"threads: {first['first_gbps']:.2f} GB/s"})
    return out


def gds_goal(gds) -> list:
    """Cold loads: the fastest GDS row against metamat's staged io=auto row of the same run
    (the io= choice keeps the faster) and the O_DIRECT read ceiling."""
    rows = (gds or {}).get("rows", [])
    staged = next((r for r in rows if r["row"].startswith("metamat staged, io=auto")), None)
    runs = [r for r in rows if r["row"].startswith("gds cuFile") and "gbps" in r
            and r.get("bytes_ok", True)]  # a row whose bytes were wrong is no candidate
    ceil = max((r["gbps"] for r in rows if r["row"].startswith("O_DIRECT")), default=None)
    if not staged:
        return []
    g = {"goal": "cold load: GDS vs staged (io= keeps the faster)",
         "staged_gbps": round(staged["gbps"], 2), "mode": (gds or {}).get("status", {}).get(
             "mode"), "direct_ceiling_gbps": ceil and round(ceil, 2)}
    if runs:
        best = max(runs, key=lambda r: r["gbps"])
        g.update(best=round(best["gbps"], 2), best_variant=best["row"],
                 faster="gds" if best["gbps"] > staged["gbps"] else "staged")
    else:
        g["gds"] = next((r.get("skipped") or r.get("error") or "bytes differ from the file"
                         for r in rows if r["row"].startswith("gds")), "no row")
    return [g]


def main() -> int:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    elapsed, budget = int(sys.argv[3]), int(sys.argv[4])
    steps = []
    tsv = work / "steps.tsv"
    if tsv.exists():
        for line in tsv.read_text().splitlines():
            name, status, rc, secs, log = line.split("\t")
            steps.append({"step": name, "status": status, "rc": int(rc), "seconds": int(secs),
                          "log": log})
    init, stage, gds = (load(work / f"{n}.json") for n in ("init", "stage", "gds"))
    env = (out / "env.txt").read_text() if (out / "env.txt").exists() else ""
    gpu = next((r.get("gpu") for r in (init or []) if r.get("gpu")), None) or \
        (stage or {}).get("gpu")
    summary = {"gpu": gpu, "elapsed_s": elapsed, "budget_s": budget, "env": env,
               "overall": "PASS" if steps and all(s["status"] in ("PASS", "SKIPPED")
                                                  for s in steps) else "FAIL",
               "steps": steps, "goals": goals(init, stage) + gds_goal(gds), "init": init,
               "stage": stage, "gds": gds}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    rows = [{"bench": "init", **r} for r in (init or [])] + \
        [{"bench": "stage", **r} for r in (stage or {}).get("rows", [])] + \
        [{"bench": "gds", **r} for r in (gds or {}).get("rows", [])]
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["gpu"] + [k for k in keys if k != "gpu"])
        w.writeheader()
        for r in rows:
            w.writerow({"gpu": gpu, **r})
    print(f"\n== goals ({gpu}):")
    for g in summary["goals"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in g.items()))
    print(f"overall {summary['overall']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
