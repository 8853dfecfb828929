"""``streamer-service demo``'s summary: its wall time broken down into phases that add up to it.

Real runs (a daemon and rank processes): on a generated sample, and with ``--uri`` on S3 (moto),
where verification re-reads every tensor through the cloud SDK and dominates the wall time.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

PHASE = re.compile(r"^  (?P<name>\S.*?)\s+(?P<seconds>\d+\.\d\d) s  \((?P<note>.*)\)$")
DAEMON_PHASES = ["metadata + plan", "daemon start", "rank start-up", "join", "stream", "verify", "rank exit", "stop, clean-up"]


def _demo(*args: str, cwd) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "streamer_service", "--log-level", "WARNING", "demo", "--ranks", "2", *args],
        capture_output=True, text=True, timeout=600, cwd=cwd,
    )  # fmt: skip
    print(result.stdout)  # the summary, shown with -s or on failure
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "demo: OK, every tensor matches safetensors" in result.stdout
    assert result.stdout.count("byte-exact") == 2
    # The demo passes nothing its daemon would not use (no "applies to in-process loads only").
    assert "RuntimeWarning" not in result.stderr, result.stderr[-3000:]
    return result.stdout


def _phases(stdout: str) -> tuple[float, dict[str, tuple[float, str]]]:
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("wall time"))
    total = float(re.match(r"wall time\s+(\d+\.\d\d) s  =$", lines[at]).group(1))
    phases = {}
    for line in lines[at + 1 :]:
        m = PHASE.match(line)
        if m is None:
            break
        phases[m["name"]] = (float(m["seconds"]), m["note"])
    return total, phases


def _adds_up(total: float, phases: dict[str, tuple[float, str]]) -> None:
    # Consecutive phases of one clock: they add up to the wall time, up to each row's rounding.
    assert sum(s for s, _ in phases.values()) == pytest.approx(total, abs=0.005 * (len(phases) + 1))
    assert all(s >= 0 for s, _ in phases.values())


@pytest.mark.parametrize("mode", ["daemon", "embedded"])
def test_the_demo_s_wall_time_is_its_phases(tmp_path, mode):
    total, phases = _phases(_demo("--size-mb", "8", *(["--embedded"] if mode == "embedded" else []), cwd=tmp_path))
    want = ["sample checkpoint", *DAEMON_PHASES]
    if mode == "embedded":
        want.remove("daemon start")
    assert list(phases) == want
    _adds_up(total, phases)
    assert phases["join"][1] == (
        "the daemon opens the checkpoint, every rank joins" if mode == "daemon" else "the rank plans its own load"
    )
    assert phases["verify"][1] == "against safetensors"
    assert phases["stream"][1].endswith("the last to finish; each rank's own below")


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_the_demo_on_a_uri_accounts_for_verification_and_start_up(backend, sample, tmp_path):
    backend.put_tree("sample", {p.name: p.read_bytes() for p in sample.iterdir()})
    total, phases = _phases(_demo("--uri", backend.uri("sample"), cwd=tmp_path))
    assert list(phases) == DAEMON_PHASES
    _adds_up(total, phases)
    assert phases["verify"][1] == "against the cloud SDK re-reading each tensor"
