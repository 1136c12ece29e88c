"""Run every benchmark module in ``bench/``, collect their results, write ``docs/benchmarks.md``.

    python bench/run_all.py            # full sizes (≈ 15 minutes on a 2-core machine)
    python bench/run_all.py --quick    # small sizes (≈ 2 minutes; results in bench/results/quick/)
    python bench/run_all.py --report   # only regenerate docs/benchmarks.md from every bench/results/*.json

Each ``bench/bench_*.py`` present runs in its own process (``--quick`` passed through), in the
order below, then any others alphabetically. A module writes ``bench/results/<name>.json`` (see
``bench/harness.py``); this script gathers every results file written during the run into
``bench/results/summary.json`` and renders ``docs/benchmarks.md``: the tables with DESIGN §8's
target and met / not met next to each figure, the machine, and the command that reproduces them.
With matplotlib installed (the ``chart`` extra) it also draws ``docs/benchmarks.png``. A quick run
writes all of these under ``bench/results/quick/`` (git-ignored) instead, so it never replaces the
committed figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import BENCH_DIR, REPO_ROOT, format_number, markdown_table, progress, results_dir, write_atomic

MODULE_ORDER = ["bench_authority.py", "bench_segment_log.py", "bench_agent_store.py", "bench_snapshot.py"]

class Paths:
    """Where a run's summary, report and chart go: full runs into the committed places
    (``bench/results/summary.json``, ``docs/benchmarks.md``); quick runs into the git-ignored
    ``bench/results/quick/`` so they never replace the committed figures."""

    def __init__(self, quick: bool) -> None:
        self.results = results_dir(quick)
        self.summary = self.results / "summary.json"
        self.report = self.results / "benchmarks.md" if quick else REPO_ROOT / "docs" / "benchmarks.md"
        self.chart = self.results / "benchmarks.png" if quick else REPO_ROOT / "docs" / "benchmarks.png"

MODULE_TIMEOUT_SECONDS = {True: 15 * 60, False: 60 * 60}


def bench_modules() -> list[Path]:
    present = {path.name: path for path in BENCH_DIR.glob("bench_*.py")}
    ordered = [present.pop(name) for name in MODULE_ORDER if name in present]
    return ordered + [present[name] for name in sorted(present)]


def run_module(path: Path, quick: bool) -> dict[str, Any]:
    """Run one bench module in its own process; return its exit code and the results it wrote."""
    command = [sys.executable, str(path)] + (["--quick"] if quick else [])
    progress(f"running python {os.path.relpath(path, REPO_ROOT)}{' --quick' if quick else ''}")
    with tempfile.NamedTemporaryFile("r", suffix=".written", encoding="utf-8") as written_log:
        environment = {**os.environ, harness.RESULTS_LOG_ENV: written_log.name}
        started = time.monotonic()
        try:
            completed = subprocess.run(
                command, cwd=REPO_ROOT, env=environment, timeout=MODULE_TIMEOUT_SECONDS[quick], check=False
            )
            returncode = completed.returncode
        except subprocess.TimeoutExpired:
            returncode = -1
            progress(f"{path.name}: timed out after {MODULE_TIMEOUT_SECONDS[quick]}s")
        seconds = time.monotonic() - started
        written = sorted({line.strip() for line in written_log.read().splitlines() if line.strip()})
    progress(f"{path.name}: exit {returncode} in {seconds:.0f}s, results {written or 'none'}")
    return {"module": path.name, "returncode": returncode, "seconds": round(seconds, 1), "results": written}


def load_results(paths: Paths, names: list[str] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for path in sorted(paths.results.glob("*.json")):
        if path == paths.summary or (names is not None and path.name not in names):
            continue
        try:
            results[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            progress(f"skipping {path.name}: {exc}")
    return results


def is_harness_result(result: Any) -> bool:
    return isinstance(result, dict) and isinstance(result.get("rows"), list) and all(
        isinstance(row, dict) and "subjects" in row for row in result["rows"]
    )


# -- The report ---------------------------------------------------------------------------------


def targets_at_a_glance(results: dict[str, Any]) -> list[str]:
    lines = [
        "| bench | mwpstore (median) | peer (median) | ratio | DESIGN §8 target | status |",
        "|---|---:|---:|---:|---|---|",
    ]
    for result in results.values():
        if not is_harness_result(result):
            continue
        for row in result["rows"]:
            if not row.get("target"):
                continue
            subjects = row["subjects"]
            primary = subjects.get(row["primary"])
            peers = list(row["target"].get("ratio_min") or {}) + list(row["target"].get("ratio_max") or {})
            # The peer the target names; else the first subject that is not a variant of the primary.
            peer_name = peers[0] if peers else next(
                (name for name in subjects if not name.startswith(row["primary"].split("_")[0])), None
            )
            peer = subjects.get(peer_name) if peer_name else None
            ratio = row.get("ratios", {}).get(f"{row['primary']}/{peer_name}")
            unit = row["unit"]
            size = row.get("size") or {}
            events = size.get("events") or size.get("records")
            lines.append(
                "| {title} | {primary} | {peer} | {ratio} | {target} | {status} |".format(
                    title=row["title"] + (f" ({events:,})" if isinstance(events, int) and events >= 1_000_000 else ""),
                    primary=f"{format_number(primary['median'])} {unit}" if primary else "not run",
                    peer=f"{peer_name}: {format_number(peer['median'])} {unit}" if peer else "",
                    ratio=f"{ratio:.2f}×" if ratio is not None else "",
                    target=row["target"]["text"],
                    status={True: "met", False: "**not met**", None: "n/a"}[row.get("met")],
                )
            )
    return lines


def machine_section(results: dict[str, Any]) -> list[str]:
    """The machine once, then when, at which commit and under which load each results file was made."""
    machines: dict[str, dict[str, Any]] = {
        name: result["machine"]
        for name, result in results.items()
        if isinstance(result, dict) and isinstance(result.get("machine"), dict)
    }
    if not machines:
        return ["(no machine facts recorded)"]
    machine = next(iter(machines.values()))
    libraries = ", ".join(f"{name} {version}" for name, version in machine.get("libraries", {}).items())
    lines = [
        f"- CPU: {machine.get('cpu_model')}, {machine.get('cores')} cores, {machine.get('memory_mib')} MiB RAM",
        f"- kernel: {machine.get('kernel')}; data directory filesystem: {machine.get('data_filesystem')} on {machine.get('data_device')}",
        f"- Python {machine.get('python')}; {libraries}",
        "",
        "| results | measured (UTC) | commit | load average at start → end | mode |",
        "|---|---|---|---|---|",
    ]
    for name, facts in machines.items():
        start = facts.get("load_average_at_start") or []
        end = facts.get("load_average_at_end") or []
        load = f"{start[0]:.1f} → {end[0]:.1f}" if start and end else (f"{start[0]:.1f}" if start else "?")
        mode = "quick" if results[name].get("quick") else "full"
        lines.append(f"| `{name}` | {facts.get('date_utc')} | {facts.get('git_commit')} | {load} | {mode} |")
    return lines


def authority_notes(result: dict[str, Any]) -> list[str]:
    sizes = (result.get("facts") or {}).get("sizes") or {}
    mwpstore = (result.get("facts") or {}).get("mwpstore") or {}
    lines = ["## How the Authority rows are measured", ""]
    if mwpstore and not mwpstore.get("available", True):
        lines += [f"- **mwpstore.Authority was not available in this run** ({mwpstore.get('why_not')}): peers only.", ""]
    lines += [
        "- `sqlite`: the acceptance transaction (receipt lookup and content-hash compare, revision "
        "check, Group head + 1, Event row with the blake3 chain hash, aggregate upsert, receipt, "
        "commit) in SQLite, WAL, `synchronous=FULL`; DESIGN §8's ratios are taken against it. "
        "`sqlite_rules`: the same, deciding with mwpstore's own rules (exactly mwpstore's work). "
        "`eventsourcing`: create + save of one aggregate per Command (no receipts, sequences or chain).",
        "- Write rows start from an empty store each round; the read, replay, redo, open, growth and "
        "memory rows use stores populated once per run (populating is not timed).",
        "- Redo: the populated store's index is replaced by a copy taken right after `group.create`, "
        "so `Authority.open` must redo every record (checked: `open_report.mode == \"redo\"`); SQLite "
        "re-applies the same Events (10,000 per transaction).",
        "- Memory: every Event is read in pages of 10,000; after each page the process's anonymous "
        "resident memory (`RssAnon`, the heap) is sampled and its peak growth over the value before "
        "reading is reported. Mapped file pages (the mmapped segments and LMDB, page cache the kernel "
        "can reclaim) are reported beside it in the results file (`file_backed_growth_mib`, "
        "`rss_peak_growth_mib`).",
    ]
    if sizes:
        lines.append(
            f"- Sizes in this run: decoded read {sizes.get('read'):,} Events (eventsourcing "
            f"{sizes.get('eventsourcing_read'):,}), redo {sizes.get('redo'):,} records, large store "
            f"{sizes.get('large'):,} Events. DESIGN §8 names 10M for the open, growth and memory rows: "
            "those are in `bench/results/authority_10m.json`, made by `python bench/bench_authority.py "
            "--results-name authority_10m --large-events 10000000 --subjects mwpstore --only open_clean "
            "--only growth --only read_memory`."
        )
    lines.append("")
    return lines


def render_report(summary: dict[str, Any]) -> str:
    results = summary["results"]
    quick = summary.get("quick")
    lines = [
        "# Benchmarks",
        "",
        "Generated by `bench/run_all.py` from `bench/results/*.json`; do not edit by hand.",
        "",
        "Reproduce:",
        "",
        "```",
        f"python bench/run_all.py{' --quick' if quick else ''}",
        "```",
        "",
        f"{'**Quick** run (small sizes; the full run is `python bench/run_all.py`). ' if quick else ''}"
        f"Report generated {summary.get('date_utc')}; when each module was measured is listed under "
        "Machine. Every figure is the median of several rounds; the peers "
        "(SQLite doing the same acceptance transaction with WAL and `synchronous=FULL`, and the "
        "`eventsourcing` library on SQLite) ran in the same process run, rounds interleaved. The "
        "machine is shared with other work, so compare ratios within a run rather than absolute "
        "figures across runs. What each subject does is described in the docstrings of "
        "`bench/bench_authority.py`, `bench/peer_sqlite.py` and `bench/peer_eventsourcing.py`. "
        "Where the time goes in the rows that miss their targets: [performance.md](performance.md).",
        "",
        "## Machine",
        "",
        *machine_section(results),
        "",
        "## DESIGN §8 targets at a glance",
        "",
        *targets_at_a_glance(results),
        "",
    ]
    if summary.get("chart"):
        lines += [f"![throughput against the peers]({Path(summary['chart']).name})", ""]
    if "authority" in results:
        lines += authority_notes(results["authority"])
    lines += ["## All rows", ""]
    for name, result in results.items():
        if is_harness_result(result):
            lines += [markdown_table(result), ""]
            facts = result.get("facts") or {}
            for peer in ("sqlite", "eventsourcing"):
                if isinstance(facts.get(peer), dict):
                    settings = ", ".join(f"{key} {value}" for key, value in facts[peer].items())
                    lines.append(f"- {peer} settings in force: {settings}")
            if result.get("command"):
                lines.append(f"- module command: `{result['command']}`; took {result.get('duration_seconds')} s")
            lines.append("")
        else:
            lines += [f"### {name}", "", f"Results in `bench/results/{name}.json` (not in the harness format).", ""]
    failed = [module for module in summary.get("modules", []) if module.get("returncode") not in (0, None)]
    if failed:
        lines += ["## Modules that failed in this run", ""]
        lines += [f"- `{module['module']}`: exit {module['returncode']}" for module in failed]
        lines.append("")
    return "\n".join(lines)


def draw_chart(results: dict[str, Any], chart_path: Path) -> Path | None:
    """A bar chart of throughput rows (log scale), one bar per subject; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib is not installed (pip install .[chart]): no chart")
        return None
    rows = [
        row
        for result in results.values()
        if is_harness_result(result)
        for row in result["rows"]
        if not row.get("lower_is_better") and len(row["subjects"]) > 1
    ]
    if not rows:
        return None
    subjects = sorted({name for row in rows for name in row["subjects"]})
    figure, axes = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 5))
    width = 0.8 / len(subjects)
    for offset, subject in enumerate(subjects):
        values = [row["subjects"].get(subject, {}).get("median", 0) for row in rows]
        axes.bar([index + offset * width for index in range(len(rows))], values, width, label=subject)
    axes.set_yscale("log")
    axes.set_xticks([index + 0.4 - width / 2 for index in range(len(rows))])
    axes.set_xticklabels([row["key"] for row in rows], rotation=30, ha="right")
    axes.set_ylabel("operations per second (median, log scale)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(chart_path, dpi=110)
    plt.close(figure)
    return chart_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every module (results in bench/results/quick/)")
    parser.add_argument("--report", action="store_true", help="do not run; regenerate the report from the results files")
    parser.add_argument("--only", action="append", default=[], help="run only modules whose file name contains this")
    args = parser.parse_args(argv)
    quick = args.quick
    paths = Paths(quick)
    paths.results.mkdir(parents=True, exist_ok=True)
    previous = json.loads(paths.summary.read_text(encoding="utf-8")) if paths.summary.exists() else {}

    modules: list[dict[str, Any]] = []
    if args.report:
        modules = previous.get("modules", [])
        names = None  # every results file present, including runs made outside run_all
    else:
        for path in bench_modules():
            if args.only and not any(part in path.name for part in args.only):
                continue
            modules.append(run_module(path, quick))
        if args.only:  # keep the other modules' entries of the last run
            ran = {module["module"] for module in modules}
            modules = [module for module in previous.get("modules", []) if module.get("module") not in ran] + modules
        names = [name for module in modules for name in module["results"]]
    results = load_results(paths, names)
    summary: dict[str, Any] = {
        "schema": harness.RESULTS_SCHEMA,
        "quick": quick,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/run_all.py" + (" --quick" if quick else ""),
        "modules": modules,
        "results": results,
    }
    chart = draw_chart(results, paths.chart)
    summary["chart"] = str(chart.relative_to(REPO_ROOT)) if chart else None
    write_atomic(paths.summary, json.dumps(summary, indent=2) + "\n")
    paths.report.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(paths.report, render_report(summary))
    progress(f"wrote {paths.summary.relative_to(REPO_ROOT)} and {paths.report.relative_to(REPO_ROOT)}")
    return 0 if all(module.get("returncode") == 0 for module in modules) else 1


if __name__ == "__main__":
    sys.exit(main())
