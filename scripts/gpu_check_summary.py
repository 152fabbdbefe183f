"""The summary of a scripts/gpu_check.sh run: summary.json, benches.csv and logs.tar.gz in the
output folder, from the run's work folder (steps.tsv, one log and maybe a JUnit XML per step,
bench output folders). Standard library only; gpu_check.sh calls it after every step, so the
output folder holds a current summary even if the whole command is stopped.

    python3 scripts/gpu_check_summary.py WORK OUT [--final] [--print]

steps.tsv: one line per step: name, status (PASS/FAIL/SKIPPED/TIMEOUT), exit code, seconds,
cap in seconds, kind (cmd / pytest), note (tab-separated). A pytest step has WORK/<name>.xml (JUnit) and
WORK/<name>.log (-v -rA output): a step whose tests all skipped is SKIPPED (with the reason);
a failing one names every failing test (from the XML; from the log when the step was stopped
before pytest wrote it, with the test that was running then). overall: FAIL (a step FAILed,
or TIMEd OUT and is not optional), INCOMPLETE (a step that is not optional was SKIPPED,
except "not selected"), else PASS; RUNNING until the final call.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
import tarfile
import time
import xml.etree.ElementTree as ET

LOG_KEEP = 8 << 20  # bytes of a log kept in logs.tar.gz: head and tail of longer ones
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nodeid(classname: str, name: str) -> str:
    """pytest's node id from a JUnit classname ('tests.test_x.TestY') and name."""
    if not classname and "." in name and "[" not in name:  # a collection error: the module
        path = name.replace(".", "/") + ".py"
        return path if os.path.exists(os.path.join(ROOT, path)) else name
    parts = [p for p in (classname or "").split(".") if p]
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(os.path.join(ROOT, path)):
            return "::".join([path] + parts[i:] + [name])
    return f"{classname}::{name}" if classname else name


def parse_junit(path: str) -> dict:
    """{'tests': {...counts}, 'failures': [{'id', 'kind', 'message'}], 'skip_reasons': [...]}"""
    root = ET.parse(path).getroot()
    counts = {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, reasons = [], []
    for case in root.iter("testcase"):
        counts["total"] += 1
        tid = nodeid(case.get("classname", ""), case.get("name", ""))
        bad = [c for c in case if c.tag in ("failure", "error")]
        skipped = [c for c in case if c.tag == "skipped"]
        if bad:
            kind = "failed" if bad[0].tag == "failure" else "errors"
            counts[kind] += 1
            msg = (bad[0].get("message") or bad[0].text or "").strip().splitlines()
            failures.append({"id": tid, "kind": bad[0].tag, "message": msg[0][:500] if msg else ""})
        elif skipped:
            counts["skipped"] += 1
            reasons.append((skipped[0].get("message") or "").strip()[:300])
        else:
            counts["passed"] += 1
    return {"tests": counts, "failures": failures, "skip_reasons": reasons}


_RESULT = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)")
_START = re.compile(r"^(tests/\S+\.py::\S+)")


def parse_verbose_log(path: str) -> dict:
    """What a `pytest -v -rA` log says when there is no XML: failing ids, the test running
    when the output ends (the step was stopped), counts."""
    counts = {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, running = [], None
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {"tests": counts, "failures": [], "running": None}
    seen = set()
    for line in lines:
        m = _RESULT.match(line)
        x = None if m else _XDIST.match(line)
        if m or x:
            tid, word = (m.group(1).strip(), m.group(2)) if m else (x.group(2), x.group(1))
            running = None
            if tid in seen:
                continue
            seen.add(tid)
            counts["total"] += 1
            key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors",
                   "SKIPPED": "skipped", "XFAIL": "skipped"}[word]
            counts[key] += 1
            if key in ("failed", "errors"):
                failures.append({"id": tid, "kind": word.lower(), "message": ""})
            continue
        m = _START.match(line)
        if m and " " not in line.strip():
            running = m.group(1)
    return {"tests": counts, "failures": failures, "running": running}


def read_steps(work: str) -> list:
    steps = []
    path = os.path.join(work, "steps.tsv")
    if not os.path.exists(path):
        return steps
    with open(path) as fh:
        lines = fh.read().splitlines()
    for line in lines:
        f = line.split("\t")
        if len(f) < 5:
            continue
        name, status, rc, secs, cap = f[:5]
        kind = f[5] if len(f) > 5 else "cmd"
        note = f[6] if len(f) > 6 else ""
        st = {"name": name, "status": status, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
              "seconds": float(secs or 0), "cap_s": int(cap or 0), "kind": kind, "note": note,
              "log": f"logs/{name}.log" if os.path.exists(os.path.join(work, f"{name}.log"))
              else None}
        xml = os.path.join(work, f"{name}.xml")
        if os.path.exists(xml):
            st["junit"] = f"logs/{name}.xml"
            try:
                info = parse_junit(xml)
            except ET.ParseError as e:
                info = {"tests": None, "failures": [], "skip_reasons": [], "junit_error": str(e)}
        elif st["log"] and status in ("FAIL", "TIMEOUT") and kind == "pytest":
            info = parse_verbose_log(os.path.join(work, f"{name}.log"))
            if info.get("running"):
                info["failures"].append({"id": info["running"], "kind": "stopped",
                                         "message": f"running when the step was stopped ({status})"})
        else:
            info = None
        if info:
            st["tests"] = info.get("tests")
            st["failing_tests"] = [x["id"] for x in info["failures"]]
            st["failures"] = info["failures"]
            t = info.get("tests") or {}
            if status == "PASS" and t.get("total") and t.get("skipped") == t.get("total"):
                st["status"] = "SKIPPED"  # nothing ran: say why
                reasons = sorted(set(info.get("skip_reasons") or []))
                st["note"] = (note + "; " if note else "") + "all tests skipped: " + \
                    " | ".join(reasons[:3])
            if status == "FAIL" and not info["failures"] and st["rc"] not in (1, None):
                st["note"] = (note + "; " if note else "") + f"pytest exit {st['rc']}"
        steps.append(st)
    return steps


def merged_benches(work: str, steps: list) -> list:
    """Every bench step's results.csv, one table with a leading 'step' column."""
    rows, header = [], None
    for st in steps:
        path = os.path.join(work, st["name"], "results.csv")
        if not os.path.exists(path):
            continue
        with open(path, newline="") as f:
            r = csv.reader(f)
            h = next(r, None)
            if h is None:
                continue
            if header is None:
                header = ["step"] + h
            for row in r:
                rows.append([st["name"]] + row)
    return [header] + rows if header else []


def _add_log(tar: tarfile.TarFile, path: str, arc: str) -> None:
    size = os.path.getsize(path)
    if size <= LOG_KEEP:
        tar.add(path, arcname=arc)
        return
    with open(path, "rb") as f:  # head and tail of a very long log (a sanitizer's, say)
        head = f.read(LOG_KEEP // 4)
        f.seek(size - (LOG_KEEP - LOG_KEEP // 4))
        tail = f.read()
    data = head + f"\n\n[... {size - len(head) - len(tail)} bytes cut ...]\n\n".encode() + tail
    info = tarfile.TarInfo(arc)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def write(work: str, out: str, final: bool) -> dict:
    steps = read_steps(work)
    meta = {}
    mpath = os.path.join(work, "meta.json")
    if os.path.exists(mpath):
        with open(mpath) as f:
            meta = json.load(f)
    order = {n: i for i, n in enumerate(meta.get("order", []))}
    steps.sort(key=lambda st: order.get(st["name"], len(order)))  # the script's order
    counts = {}
    for st in steps:
        counts[st["status"]] = counts.get(st["status"], 0) + 1
    optional = set(meta.get("optional_steps", []))
    bad = [st["name"] for st in steps if st["status"] == "FAIL"
           or (st["status"] == "TIMEOUT" and st["name"] not in optional)]
    missing = [st["name"] for st in steps if st["status"] == "SKIPPED"
               and st["name"] not in optional and not st["note"].startswith("not selected")]
    overall = "FAIL" if bad else "INCOMPLETE" if missing else "PASS"
    files = ["summary.json", "logs.tar.gz", "gpu_check.log"]
    table = merged_benches(work, steps)
    if table:
        with open(os.path.join(out, "benches.csv"), "w", newline="") as f:
            csv.writer(f).writerows(table)
        files.append("benches.csv")
    summary = {
        "overall": overall if final else "RUNNING",
        "final": final,
        "failed_steps": bad,
        "skipped_steps": [st["name"] for st in steps if st["status"] == "SKIPPED"],
        "incomplete_steps": missing,
        "counts": counts,
        **meta,
        "elapsed_s": round(time.time() - meta.get("start_epoch", time.time()), 1),
        "steps": steps,
        "files": files,
        "logs": "logs.tar.gz holds logs/<step>.log, logs/<step>.xml (JUnit), logs/<bench step>/",
    }
    tmp = os.path.join(out, ".summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, os.path.join(out, "summary.json"))
    tmp = os.path.join(out, ".logs.tar.gz.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in sorted(os.listdir(work)):
            p = os.path.join(work, name)
            if os.path.isfile(p):
                _add_log(tar, p, f"logs/{name}")
            elif os.path.isdir(p):
                for dirpath, _, fnames in os.walk(p):
                    for fn in sorted(fnames):
                        fp = os.path.join(dirpath, fn)
                        _add_log(tar, fp, "logs/" + os.path.relpath(fp, work))
    os.replace(tmp, os.path.join(out, "logs.tar.gz"))
    return summary


def short(summary: dict) -> str:
    lines = [f"== summary: {summary['overall']} in {summary['elapsed_s']:.0f}s "
             f"(budget {summary.get('budget_s', '?')}s) "
             + " ".join(f"{k}={v}" for k, v in sorted(summary["counts"].items()))]
    for st in summary["steps"]:
        t = st.get("tests") or {}
        tests = (f" tests {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                 f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped") if t else ""
        lines.append(f"   {st['name']:<16} {st['status']:<8} {st['seconds']:>6.0f}s"
                     f"{tests}{'  (' + st['note'] + ')' if st['note'] else ''}")
        for f in (st.get("failures") or [])[:20]:
            lines.append(f"      {f['kind']}: {f['id']}  {f['message'][:160]}")
        if len(st.get("failures") or []) > 20:
            lines.append(f"      ... {len(st['failures']) - 20} more in summary.json")
    return "\n".join(lines)


def main(argv) -> int:
    args = [a for a in argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    work, out = args
    summary = write(work, out, "--final" in argv)
    if "--print" in argv:
        print(short(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
