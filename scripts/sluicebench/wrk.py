"""Running wrk and reading its output."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from .procs import Failure, Procs


@dataclass
class Result:
    requests: int
    rps: float
    p50_ms: Optional[float]
    p99_ms: Optional[float]
    errors: str  # wrk's "Non-2xx" and "Socket errors" lines, "" when it reported none
    text: str


def seconds(duration: str) -> float:
    """wrk's duration syntax (10s, 2m, 1h, or bare seconds) in seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", duration.strip())
    if not m:
        raise Failure(f"cannot read the duration {duration!r} (e.g. 10s, 2m)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def to_ms(value: str) -> Optional[float]:
    """A wrk latency (us, ms or s) in milliseconds."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value)
    if not m:
        return None
    return float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000, "m": 60000}[m.group(2)]


def parse(text: str) -> Result:
    requests = re.search(r"^\s*(\d+) requests in", text, re.M)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    if not requests or not rps:
        raise Failure(f"could not read wrk's output:\n{text}")
    lat = dict(re.findall(r"^\s+(\d+)%\s+(\S+)$", text, re.M))
    errors = "; ".join(line.strip() for line in text.splitlines()
                       if "Non-2xx" in line or "Socket errors" in line)
    return Result(int(requests.group(1)), float(rps.group(1)),
                  to_ms(lat["50"]) if "50" in lat else None,
                  to_ms(lat["99"]) if "99" in lat else None, errors, text)


def args(threads: int, connections: int, headers: Sequence[str] = (),
         script: Optional[str] = None) -> list[str]:
    a = [f"-t{threads}", f"-c{connections}"]
    for h in headers:
        a += ["-H", h]
    if script:
        a += ["-s", script]
    return a


def run(procs: Procs, url: str, wrk_args: Sequence[str], duration: str,
        latency: bool = True) -> Result:
    """One wrk run of DURATION; bounded by a timeout well past it."""
    argv = ["wrk", *wrk_args, f"-d{duration}"] + (["--latency"] if latency else []) + [url]
    text = procs.run(argv, timeout=seconds(duration) + 60)
    return parse(text)
