"""Knobs, required tools, binaries and the facts every report starts with."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from .procs import Failure, log

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmark-runs.md"


class Knobs:
    """Settings read from the environment, each with its default; remembers what was read so
    a report can print the command line that reproduces it."""

    def __init__(self) -> None:
        self.used: dict[str, str] = {}

    def str(self, name: str, default: str) -> str:
        value = os.environ.get(name, default)
        self.used[name] = value
        return value

    def int(self, name: str, default: int, minimum: int = 0) -> int:
        raw = self.str(name, str(default))
        if not re.fullmatch(r"\d+", raw) or int(raw) < minimum:
            raise Failure(f"{name} must be an integer of at least {minimum}, not {raw!r}")
        return int(raw)

    def choice(self, name: str, default: str, allowed: Sequence[str]) -> str:
        value = self.str(name, default)
        if value not in allowed:
            raise Failure(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        return value

    def line(self, names: Sequence[str]) -> str:
        """ "A=1 B=2" for NAMES, quoting values with spaces (as a shell would need)."""
        out = []
        for n in names:
            if n == "BUILD" and os.environ.get("SLUICE_BIN_DIR"):
                # The binary came from SLUICE_BIN_DIR: nothing was built, whatever BUILD says.
                out.append("SLUICE_BIN_DIR=DIR")
                continue
            v = self.used[n]
            out.append(f'{n}="{v}"' if " " in v else f"{n}={v}")
        return " ".join(out)


def require(name: str, tools: Sequence[str], debian: str) -> None:
    """Fails, naming what is missing, unless every tool is on PATH. The drivers install
    nothing themselves."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise Failure(f"missing: {' '.join(missing)}. On Debian: {debian}")


def sluice_binary(name: str, knobs: Knobs, bins: Sequence[str] = ("--bin", "sluice")) -> Path:
    """The release sluice binary: from SLUICE_BIN_DIR if set; otherwise built with cargo
    (unless BUILD=0) into ${CARGO_TARGET_DIR:-target}/release."""
    bin_dir = os.environ.get("SLUICE_BIN_DIR")
    build = knobs.choice("BUILD", "1", ("0", "1"))
    if bin_dir:
        path = Path(bin_dir) / "sluice"
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR", "target"))
        if not target.is_absolute():
            target = ROOT / target
        if build == "1":
            if shutil.which("cargo") is None:
                raise Failure("cargo is missing: install a Rust toolchain, or set BUILD=0 or SLUICE_BIN_DIR")
            log(name, f"building: cargo build --release {' '.join(bins)}")
            # Bounded like everything else: a clean release build takes ~5 minutes here.
            # cargo's own output goes to stderr, like the driver's progress lines: stdout is the report.
            subprocess.run(["cargo", "build", "--release", *bins], cwd=ROOT, check=True,
                           stdout=sys.stderr, timeout=3600)
        path = target / "release" / "sluice"
    if not os.access(path, os.X_OK):
        raise Failure(f"no executable {path} (build it, or set SLUICE_BIN_DIR)")
    return path


def sluice_binaries(name: str, knobs: Knobs, key: str, label: str) -> list[tuple[str, str, Path]]:
    """The sluice binaries a driver runs side by side, as (key, label, path): SLUICE_BIN_DIR's (or
    a fresh build) under `key`, and, when SLUICE_BIN_DIR_B is set, that directory's under
    `key`'s B twin, so that one run compares two builds on the same machine at the same moment."""
    bins = [(key, label, sluice_binary(name, knobs))]
    other = os.environ.get("SLUICE_BIN_DIR_B")
    if other:
        b_key = key.replace("sluice", "sluice_b", 1) if key.startswith("sluice") else f"{key}_b"
        bins.append((b_key, "sluice B (SLUICE_BIN_DIR_B)", Path(other) / "sluice"))
    return bins


def bin_dirs() -> str:
    """The SLUICE_BIN_DIR* settings of this run, as they go in a report's command line."""
    dirs = " ".join(f"{n}=DIR" for n in ("SLUICE_BIN_DIR", "SLUICE_BIN_DIR_B") if os.environ.get(n))
    return f"{dirs} " if dirs else ""


def git_revision() -> str:
    """ "7488ba8" or "7488ba8 (with uncommitted changes)" """
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "?"
        dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"],
                               capture_output=True, timeout=30).returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return head + (" (with uncommitted changes)" if dirty else "")


def version_of(argv: Sequence[str], pattern: str, template: str) -> str:
    """A tool's version, read from the first match of PATTERN in what ARGV prints."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(pattern, p.stdout + p.stderr)
    return m.expand(template) if m else "?"


def wrk_version() -> str:
    return version_of(["wrk", "-v"], r"^(\S+) (\S+)", r"\1 \2")


def nginx_version() -> str:
    return version_of(["nginx", "-v"], r"nginx version: (\S+)", r"\1")


def haproxy_version() -> str:
    return version_of(["haproxy", "-v"], r"HAProxy version (\S+)", r"HAProxy \1")


def redis_version() -> str:
    return version_of(["redis-server", "--version"], r"v=(\S+)", r"Redis \1")


def nproc() -> int:
    """The machine's CPUs, as `nproc` prints them before REDIS_CPU narrows this process's
    affinity: the reports' "on N cores" is about the box."""
    return len(_CPUS_AT_START)


_CPUS_AT_START = frozenset(os.sched_getaffinity(0))


# CLIENTS=basic: the `clients` section and the header of one identified caller, so that the
# cost of identification (a Basic Proxy-Authorization decoded and its token's digest compared
# with every listed one) can be set against the same route without clients.
BENCH_CLIENT, BENCH_TOKEN = "bench", "bench-token-0123456789abcdef"


def clients_yaml(mode: str) -> str:
    """`clients:` in enforce mode with one client granted every route (CLIENTS=basic), or ""
    (CLIENTS=off, and CLIENTS=header: the same header sent, no clients to identify, so that
    the cost of identification is told from that of carrying the header)."""
    if mode != "basic":
        return ""
    return ("clients:\n  mode: enforce\n  list:\n"
            f'    - {{ name: {BENCH_CLIENT}, tokens: ["{BENCH_TOKEN}"], routes: ["*"] }}\n')


def clients_headers(mode: str) -> list[str]:
    """What the load generator sends to be that client."""
    if mode == "off":
        return []
    basic = base64.b64encode(f"{BENCH_CLIENT}:{BENCH_TOKEN}".encode()).decode()
    return [f"Proxy-Authorization: Basic {basic}"]
