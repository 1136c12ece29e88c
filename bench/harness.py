"""The benchmark harness: rounds, medians, ratios against peers, a results JSON and a Markdown table.

A bench module builds one :class:`Bench`, adds rows, and in each row measures several *subjects*
(``mwpstore`` and its peers ``sqlite`` and ``eventsourcing``) in the same run, rounds interleaved
so that a burst of load from a neighbour on this shared machine hits every subject alike::

    bench = Bench("authority", quick=args.quick)
    row = bench.row("accept_single", "durable accept, 1 thread, one commit each",
                    unit="Commands/s", target=Target("≥ 1.5× SQLite", ratio_min={"sqlite": 1.5}))
    row.compare({"mwpstore": run_mwpstore, "sqlite": run_sqlite}, rounds=5)
    bench.finish()          # bench/results/authority.json, bench/results/authority.md, table on stdout

A subject function takes a :class:`RoundContext` and returns how many operations it performed.
It may wrap its measured part in ``with ctx.timed():`` (setup outside is not timed); otherwise the
whole call is timed. For rows in time units (``"s"``, ``"ms"``) the value is the timed duration; for other
lower-is-better units (``"MiB"``) the function returns the value itself. Each round runs in a
fresh directory (``ctx.dir``) on the same filesystem as the repository, never on tmpfs
(``MWPSTORE_BENCH_DIR`` overrides).

Progress goes to stderr; the table goes to stdout. Quote medians; never assert speed in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
WORK_DIR_FALLBACK = BENCH_DIR / ".work"

if str(REPO_ROOT) not in sys.path:  # the bench scripts run from a checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

RESULTS_SCHEMA = "mwpstore-bench/1"
RESULTS_LOG_ENV = "MWPSTORE_BENCH_RESULTS_LOG"
_TIME_UNITS = {"s": 1.0, "ms": 1e3, "µs": 1e6}
_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "overlay-tmpfs"}
_LIBRARIES = ["mwpstore", "eventsourcing", "msgspec", "blake3", "lmdb", "cryptography", "cffi"]

_started = time.monotonic()


def progress(message: str) -> None:
    """One line of progress on stderr, prefixed with the seconds since the process started."""
    print(f"[{time.monotonic() - _started:7.1f}s] {message}", file=sys.stderr, flush=True)


# -- Machine facts ------------------------------------------------------------------------------


def mount_of(path: Path) -> dict[str, str]:
    """The mount (device, mount point, filesystem type) that holds ``path``, from /proc/mounts."""
    real = os.path.realpath(path)
    best = {"device": "?", "mount_point": "/", "fstype": "?"}
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) < 3:
                    continue
                device, mount_point, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best["mount_point"]):
                    best = {"device": device, "mount_point": mount_point, "fstype": fstype}
    except OSError:
        pass
    return best


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def library_versions() -> dict[str, str]:
    from importlib import metadata

    versions: dict[str, str] = {}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "mwpstore":
                try:
                    from mwpstore._version import __version__

                    versions[name] = f"{__version__} (checkout)"
                except ImportError:
                    versions[name] = "absent"
            else:
                versions[name] = "absent"
    import sqlite3

    versions["sqlite"] = sqlite3.sqlite_version
    return versions


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=False,
        )
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def memory_total_mib() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def machine_facts(data_dir: Path) -> dict[str, Any]:
    mount = mount_of(data_dir)
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "memory_mib": memory_total_mib(),
        "kernel": platform.release(),
        "os": platform.platform(),
        "hostname": socket.gethostname(),
        "data_dir": str(data_dir),
        "data_filesystem": mount["fstype"],
        "data_device": mount["device"],
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "libraries": library_versions(),
        "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": list(os.getloadavg()),
    }


# -- Where benchmarks write ---------------------------------------------------------------------


def choose_work_root() -> Path:
    """A directory on a real disk and on the repository's filesystem for the benchmark stores.

    The system temp dir qualifies when it is not a memory filesystem and lives on the same device
    as the repository; otherwise ``bench/.work/`` (git-ignored) is used.
    """
    override = os.environ.get("MWPSTORE_BENCH_DIR")
    if override:
        root = Path(override)
        root.mkdir(parents=True, exist_ok=True)
        return root
    system_tmp = Path(tempfile.gettempdir())
    try:
        same_device = os.stat(system_tmp).st_dev == os.stat(REPO_ROOT).st_dev
    except OSError:
        same_device = False
    if same_device and mount_of(system_tmp)["fstype"] not in _MEMORY_FILESYSTEMS:
        return system_tmp
    WORK_DIR_FALLBACK.mkdir(parents=True, exist_ok=True)
    return WORK_DIR_FALLBACK


# -- Measurements ------------------------------------------------------------------------------


@dataclass
class RoundContext:
    """What a subject function gets for one round: a fresh directory and an optional timer."""

    dir: Path
    round: int
    quick: bool
    seconds: float | None = None
    cpu_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time only the block inside; call once per round (a second call adds to the first).

        Also records the process's CPU time (all threads) over the block: on a loaded machine,
        operations per CPU-second moves less than the wall-clock rate for CPU-bound rows.
        """
        start = time.perf_counter()
        cpu_start = time.process_time()
        try:
            yield
        finally:
            self.seconds = (self.seconds or 0.0) + time.perf_counter() - start
            self.cpu_seconds = (self.cpu_seconds or 0.0) + time.process_time() - cpu_start


SubjectFunction = Callable[[RoundContext], int | float]


@dataclass
class Measurement:
    subject: str
    values: list[float]
    counts: list[float]
    seconds: list[float]
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    cpu_seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def to_json(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
            "rounds": self.values,
            "operations": self.counts,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "extra": self.extra,
            "note": self.note,
        }


@dataclass
class Target:
    """A DESIGN §8 target. ``value_min``/``value_max`` bound the primary subject's median;
    ``ratio_min``/``ratio_max`` bound primary ÷ peer medians, by peer name."""

    text: str
    value_min: float | None = None
    value_max: float | None = None
    ratio_min: dict[str, float] = field(default_factory=dict)
    ratio_max: dict[str, float] = field(default_factory=dict)

    def evaluate(self, primary: str, medians: dict[str, float]) -> tuple[bool | None, list[str]]:
        """(met, reasons): met is None when a subject the target needs was not measured."""
        reasons: list[str] = []
        met: bool | None = True
        value = medians.get(primary)
        needs_value = self.value_min is not None or self.value_max is not None
        if needs_value or self.ratio_min or self.ratio_max:
            if value is None:
                return None, [f"{primary} not measured"]
        if self.value_min is not None and value is not None and value < self.value_min:
            met = False
            reasons.append(f"{format_number(value)} < {format_number(self.value_min)}")
        if self.value_max is not None and value is not None and value > self.value_max:
            met = False
            reasons.append(f"{format_number(value)} > {format_number(self.value_max)}")
        for peer, bound in list(self.ratio_min.items()) + list(self.ratio_max.items()):
            if peer not in medians or not medians[peer] or value is None:
                return None, reasons + [f"{peer} not measured"]
        for peer, bound in self.ratio_min.items():
            ratio = value / medians[peer]  # type: ignore[operator]
            if ratio < bound:
                met = False
                reasons.append(f"{ratio:.2f}× {peer} < {bound}×")
        for peer, bound in self.ratio_max.items():
            ratio = value / medians[peer]  # type: ignore[operator]
            if ratio > bound:
                met = False
                reasons.append(f"{ratio:.2f}× {peer} > {bound}×")
        return met, reasons

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "value_min": self.value_min,
            "value_max": self.value_max,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
        }


def format_number(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 1e6:
        return f"{value / 1e6:.2f}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.1f}k"
    if magnitude >= 1e3:
        return f"{value / 1e3:.2f}k"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2e}"


class Row:
    """One benchmark line of DESIGN §8: several subjects measured on the same work."""

    def __init__(
        self,
        bench: Bench,
        key: str,
        title: str,
        *,
        unit: str,
        target: Target | None,
        primary: str,
        size: dict[str, Any] | None,
    ) -> None:
        self.bench = bench
        self.key = key
        self.title = title
        self.unit = unit
        self.target = target
        self.primary = primary
        self.size = size or {}
        self.measurements: dict[str, Measurement] = {}
        self.notes: list[str] = []
        self.errors: dict[str, str] = {}

    @property
    def lower_is_better(self) -> bool:
        return self.unit in ("s", "ms", "µs", "MiB")

    def compare(self, subjects: dict[str, SubjectFunction | None], rounds: int | None = None) -> None:
        """Measure every subject for ``rounds`` rounds, interleaved; None marks a subject as absent."""
        rounds = rounds or self.bench.rounds
        present = {name: fn for name, fn in subjects.items() if fn is not None}
        for name in subjects:
            if name not in present:
                self.notes.append(f"{name}: not available in this run")
        failed: set[str] = set()
        for round_index in range(rounds):
            for name, fn in present.items():
                if name in failed:
                    continue
                try:
                    self._run_round(name, fn, round_index, rounds)
                except Exception as exc:  # a subject that breaks must not sink the others
                    failed.add(name)
                    message = f"{type(exc).__name__}: {exc}"
                    self.errors[name] = message
                    progress(f"  {self.key} / {name}: FAILED {message}")
                    if os.environ.get("MWPSTORE_BENCH_RAISE"):
                        raise

    def measure(self, subject: str, fn: SubjectFunction, rounds: int | None = None) -> None:
        self.compare({subject: fn}, rounds)

    def record(self, subject: str, values: list[float], *, extra: dict[str, Any] | None = None, note: str = "") -> None:
        """Record values measured outside the harness (e.g. a peak RSS in MiB)."""
        self.measurements[subject] = Measurement(
            subject, list(values), [float("nan")] * len(values), [float("nan")] * len(values), extra or {}, note
        )

    def _run_round(self, name: str, fn: SubjectFunction, round_index: int, rounds: int) -> None:
        with self.bench.fresh_dir(f"{self.key}-{name}-r{round_index}") as directory:
            context = RoundContext(dir=directory, round=round_index, quick=self.bench.quick)
            start = time.perf_counter()
            cpu_start = time.process_time()
            count = fn(context)
            elapsed = time.perf_counter() - start
            cpu_elapsed = time.process_time() - cpu_start
        seconds = context.seconds if context.seconds is not None else elapsed
        cpu_seconds = context.cpu_seconds if context.cpu_seconds is not None else cpu_elapsed
        if self.unit in _TIME_UNITS:
            value = seconds * _TIME_UNITS[self.unit]
        elif self.lower_is_better:
            value = float(count)
        else:
            value = float(count) / seconds if seconds > 0 else float("inf")
        measurement = self.measurements.setdefault(name, Measurement(name, [], [], []))
        measurement.values.append(value)
        measurement.counts.append(float(count))
        measurement.seconds.append(seconds)
        measurement.cpu_seconds.append(cpu_seconds)
        for extra_key, extra_value in context.extra.items():
            measurement.extra.setdefault(extra_key, []).append(extra_value)
        progress(
            f"  {self.key} / {name} round {round_index + 1}/{rounds}: {format_number(value)} {self.unit}"
            + (f"  {context.extra}" if context.extra else "")
        )

    def medians(self) -> dict[str, float]:
        """Each subject's median; a subject that failed has none (so no ratio or verdict rests on a
        broken run, even when rounds before the failure were measured)."""
        return {
            name: measurement.median
            for name, measurement in self.measurements.items()
            if measurement.values and name not in self.errors
        }

    def ratios(self) -> dict[str, float]:
        """primary ÷ each other subject, on medians (for seconds rows: lower is better, read accordingly)."""
        medians = self.medians()
        primary = self.primary if self.primary in medians else None
        if primary is None:
            return {}
        return {
            f"{primary}/{name}": medians[primary] / value
            for name, value in medians.items()
            if name != primary and value
        }

    def verdict(self) -> tuple[bool | None, list[str]]:
        if self.target is None:
            return None, []
        return self.target.evaluate(self.primary, self.medians())

    def to_json(self) -> dict[str, Any]:
        met, reasons = self.verdict()
        return {
            "key": self.key,
            "title": self.title,
            "unit": self.unit,
            "lower_is_better": self.lower_is_better,
            "primary": self.primary,
            "size": self.size,
            "subjects": {name: measurement.to_json() for name, measurement in self.measurements.items()},
            "ratios": self.ratios(),
            "target": self.target.to_json() if self.target else None,
            "met": met,
            "verdict_reasons": reasons,
            "notes": self.notes,
            "errors": self.errors,
        }


class Bench:
    """One bench module's run: its rows, its machine facts, its output files."""

    def __init__(self, name: str, *, quick: bool = False, rounds: int | None = None, command: str | None = None) -> None:
        self.name = name
        self.quick = quick
        self.rounds = rounds or (3 if quick else 5)
        self.command = command or "python " + " ".join([os.path.relpath(sys.argv[0], REPO_ROOT)] + sys.argv[1:])
        self.work_root = choose_work_root()
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"mwpstore-bench-{name}-", dir=self.work_root))
        self.machine = machine_facts(self.run_dir)
        self.rows: list[Row] = []
        self.facts: dict[str, Any] = {}  # e.g. each peer's durability settings, sizes
        self.started = time.monotonic()
        progress(
            f"bench {name}: {'quick' if quick else 'full'}, {self.rounds} rounds, data in {self.run_dir} "
            f"({self.machine['data_filesystem']} on {self.machine['data_device']})"
        )

    def row(
        self,
        key: str,
        title: str,
        *,
        unit: str,
        target: Target | None = None,
        primary: str = "mwpstore",
        size: dict[str, Any] | None = None,
    ) -> Row:
        progress(f"row {key}: {title}")
        row = Row(self, key, title, unit=unit, target=target, primary=primary, size=size)
        self.rows.append(row)
        return row

    @contextlib.contextmanager
    def fresh_dir(self, label: str) -> Iterator[Path]:
        """A new empty directory under this run's directory, removed afterwards."""
        directory = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=self.run_dir))
        try:
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def fixture_dir(self, label: str) -> Path:
        """A directory kept for the whole run (e.g. a populated store that several rows read)."""
        directory = self.run_dir / f"fixture-{label}"
        directory.mkdir(exist_ok=True)
        return directory

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RESULTS_SCHEMA,
            "name": self.name,
            "quick": self.quick,
            "rounds": self.rounds,
            "command": self.command,
            "duration_seconds": round(time.monotonic() - self.started, 1),
            "machine": {**self.machine, "load_average_at_end": list(os.getloadavg())},
            "facts": self.facts,
            "rows": [row.to_json() for row in self.rows],
        }

    def finish(self, *, keep_data: bool = False) -> dict[str, Any]:
        """Write ``<results>/<name>.json`` and ``.md``, print the table, remove the data.

        Full runs write ``bench/results/`` (committed); quick runs ``bench/results/quick/``
        (git-ignored), so a quick run never overwrites the committed figures.
        """
        result = self.to_json()
        directory = results_dir(self.quick)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / f"{self.name}.json", json.dumps(result, indent=2, sort_keys=False) + "\n")
        table = markdown_table(result)
        write_atomic(directory / f"{self.name}.md", table + "\n")
        written_log = os.environ.get(RESULTS_LOG_ENV)
        if written_log:  # run_all.py learns which results this process wrote
            with open(written_log, "a", encoding="utf-8") as log:
                log.write(f"{self.name}.json\n")
        print(table)
        if not keep_data:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        progress(f"bench {self.name}: done in {result['duration_seconds']}s -> {directory / (self.name + '.json')}")
        return result


def results_dir(quick: bool) -> Path:
    """Where results go: ``bench/results/`` for full runs, ``bench/results/quick/`` for quick ones."""
    return RESULTS_DIR / "quick" if quick else RESULTS_DIR


def write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


# -- Tables -------------------------------------------------------------------------------------


def _met_text(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "n/a"}[met]


def markdown_table(result: dict[str, Any], *, heading: bool = True) -> str:
    """The Markdown table of one results JSON: a line per subject, the ratio and the target."""
    lines: list[str] = []
    if heading:
        mode = "quick" if result.get("quick") else "full"
        lines.append(f"### {result['name']} ({mode}; medians, rounds in parentheses)")
        lines.append("")
    lines.append("| bench | subject | median | min … max (rounds) | primary ÷ subject | DESIGN §8 target | status |")
    lines.append("|---|---|---:|---:|---:|---|---|")
    for row in result["rows"]:
        subjects = row["subjects"]
        ratios = row.get("ratios", {})
        target = row.get("target") or {}
        size = ", ".join(
            f"{value:,} {key}" if isinstance(value, int) else f"{key} {value}" for key, value in row.get("size", {}).items()
        )
        title = row["title"] + (f" ({size})" if size else "")
        first = True
        names = [row["primary"]] if row["primary"] in subjects else []
        names += [name for name in subjects if name not in names]
        if not names:
            names = [""]
        for name in names:
            data = subjects.get(name)
            if data:
                median = f"{format_number(data['median'])} {row['unit']}"
                spread = f"{format_number(data['min'])} … {format_number(data['max'])}"
                if data.get("rounds"):
                    spread += f" ({len(data['rounds'])})"
            else:
                median = spread = "—"
            ratio_key = f"{row['primary']}/{name}"
            ratio = f"{ratios[ratio_key]:.2f}×" if ratio_key in ratios else ""
            error = row.get("errors", {}).get(name)
            if error:
                median = f"failed: {error[:60]}"
            lines.append(
                f"| {title if first else ''} | {name} | {median} | {spread} | {ratio} | "
                f"{target.get('text', '') if first else ''} | {_met_text(row.get('met')) if first else ''} |"
            )
            first = False
        for note in row.get("notes", []):
            lines.append(f"|  | *{note}* |  |  |  |  |  |")
    return "\n".join(lines)


# -- Command line -------------------------------------------------------------------------------


def argument_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes and 3 rounds, results in bench/results/quick/ (a quick look; CI runs no benchmarks)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per subject (default 5, quick 3)")
    parser.add_argument("--only", action="append", default=[], help="run only rows whose key contains this (repeatable)")
    parser.add_argument("--keep-data", action="store_true", help="keep the benchmark stores for inspection")
    return parser


def selected(args: argparse.Namespace, key: str) -> bool:
    return not args.only or any(part in key for part in args.only)


# -- Memory ------------------------------------------------------------------------------------


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB, from /proc/self/status."""
    current = peak = 0.0
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return current, peak


def rss_parts_mib() -> dict[str, float]:
    """This process's resident memory by kind, in MiB: ``anon`` (heap: what a leak would grow),
    ``file`` (mapped file pages, e.g. mmapped segments and LMDB: page cache the kernel can drop),
    ``total``."""
    parts = {"anon": 0.0, "file": 0.0, "total": 0.0}
    names = {"RssAnon:": "anon", "RssFile:": "file", "VmRSS:": "total"}
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            name = names.get(line.split(":", 1)[0] + ":")
            if name is not None:
                parts[name] = int(line.split()[1]) / 1024
    return parts


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark for this process (Linux ≥ 4.0); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False
