"""systemd/specd.service and the replica template systemd/specd@.service pass `systemd-analyze verify`
silently and score <= 2.0 on `systemd-analyze security --offline=true`; the template keeps every setting of
specd.service but the per-instance ones; the example config files match `specd serve`'s flags.

systemd-analyze comes with Debian's `systemd` package (apt-get install -y systemd) and works without
systemd running as init. CI installs it, so a missing tool is a test FAILURE, not a skip.

`verify` checks that ExecStart's binary exists; the unit names the installed path
(/opt/specd/.venv/bin/specd), so the test verifies a temporary copy whose ExecStart points at a stub
executable; nothing else in the unit is changed. The template is verified as an instance
(specd@8801.service), the way systemd loads it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess

import pytest
import tomllib
from conftest import ROOT

pytestmark = pytest.mark.timeout(120)

UNIT = ROOT / "systemd" / "specd.service"
TEMPLATE = ROOT / "systemd" / "specd@.service"
# unit file -> the name it is verified under (a template as one of its instances)
UNITS = {UNIT: "specd.service", TEMPLATE: "specd@8801.service"}
TOML_EXAMPLE = ROOT / "systemd" / "specd.toml.example"
ENV_EXAMPLE = ROOT / "systemd" / "specd.env.example"
INSTALLED_EXEC = "/opt/specd/.venv/bin/specd"
MAX_EXPOSURE = 2.0


def _analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.fail(
            "systemd-analyze not found: install it with `apt-get install -y --no-install-recommends "
            "systemd` (Debian; works without systemd as init)"
        )
    return exe


def _run(args: list, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, SYSTEMD_LOG_COLOR="0", SYSTEMD_COLORS="0", SYSTEMD_PAGER="", PAGER="cat", LC_ALL="C.UTF-8")
    return subprocess.run([_analyze(), *args], capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


def unit_settings(path=UNIT) -> dict:
    """``{(section, key): [values...]}`` of a unit file (keys may repeat; continuation lines joined)."""
    out: dict = {}
    section = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, _, v = line.partition("=")
        out.setdefault((section, k.strip()), []).append(v.strip())
    return out


def _seconds(v: str) -> float:
    total, units = 0.0, {"min": 60, "ms": 0.001, "s": 1, "h": 3600, "": 1}
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(min|ms|s|h|)", v):
        total += float(num) * units[unit]
    return total


@pytest.mark.parametrize("path", list(UNITS), ids=[p.name for p in UNITS])
def test_verify_prints_nothing(tmp_path, path):
    text = path.read_text()
    assert f"ExecStart={INSTALLED_EXEC} " in text
    stub = tmp_path / "opt" / "specd" / ".venv" / "bin" / "specd"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    unit = tmp_path / UNITS[path]
    unit.write_text(text.replace(f"ExecStart={INSTALLED_EXEC} ", f"ExecStart={stub} "))
    r = _run(["verify", str(unit)], cwd=tmp_path)
    output = (r.stdout + r.stderr).strip()
    assert output == "" and r.returncode == 0, f"systemd-analyze verify (rc {r.returncode}) said:\n{output}"


@pytest.mark.parametrize("path", list(UNITS), ids=[p.name for p in UNITS])
def test_security_exposure_at_most_2(path):
    r = _run(["security", "--offline=true", str(path)])
    out = r.stdout + r.stderr
    m = re.search(r"Overall exposure level for \S+:\s*(\d+(?:\.\d+)?)", out)
    assert m, f"no exposure level in systemd-analyze security output (rc {r.returncode}):\n{out}"
    level = float(m.group(1))
    assert level <= MAX_EXPOSURE, f"exposure {level} > {MAX_EXPOSURE}:\n" + "\n".join(
        ln for ln in out.splitlines() if ln.startswith("✗")
    )


def test_unit_lifecycle_settings():
    s = unit_settings()
    svc = lambda k: s.get(("Service", k), [])  # noqa: E731
    assert svc("Type") == ["notify"] and svc("NotifyAccess") == ["main"]
    assert svc("Restart") == ["on-failure"]
    wd = _seconds(svc("WatchdogSec")[0])
    assert 10 <= wd <= 300, "the watchdog must allow a slow engine step (the daemon pings every WatchdogSec/2)"
    exec_start = svc("ExecStart")[0]
    assert exec_start.startswith(INSTALLED_EXEC + " serve") and "--config /etc/specd/specd.toml" in exec_start
    assert "-/etc/specd/specd.env" in svc("EnvironmentFile")
    # the drain deadline (specd.toml.example / the CLI default) + margin fits in TimeoutStopSec
    drain = tomllib.loads(TOML_EXAMPLE.read_text())["drain_timeout"]
    assert _seconds(svc("TimeoutStopSec")[0]) >= drain + 15
    assert svc("DynamicUser") == ["yes"] or svc("User")
    assert svc("CapabilityBoundingSet") == [""] and svc("NoNewPrivileges") == ["yes"]
    assert svc("DevicePolicy") == ["closed"]
    allowed = " ".join(svc("DeviceAllow"))
    for dev in (
        "char-nvidia-frontend",
        "char-nvidia-uvm",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
    ):
        assert dev in allowed
    env = " ".join(svc("Environment"))
    assert "TRITON_CACHE_DIR=/var/cache/specd/" in env and "HF_HOME=/var/lib/specd/" in env
    assert svc("StateDirectory") == ["specd"] and svc("CacheDirectory") == ["specd"]


# settings of specd@.service that differ from specd.service's (everything else must be identical)
TEMPLATE_ONLY = {
    ("Unit", "Description"),
    ("Service", "ExecStart"),
    ("Service", "Environment"),
    ("Service", "EnvironmentFile"),
    ("Service", "User"),
}


def test_template_is_specd_service_per_port():
    s, t = unit_settings(UNIT), unit_settings(TEMPLATE)
    drift = sorted(k for k in set(s) | set(t) if k not in TEMPLATE_ONLY and s.get(k) != t.get(k))
    assert not drift, f"specd@.service and specd.service differ in {drift}: keep them in step"
    svc = lambda k: t.get(("Service", k), [])  # noqa: E731
    assert svc("ExecStart") == [s[("Service", "ExecStart")][0] + " --port %i"], "the instance name is the port"
    assert svc("EnvironmentFile") == ["-/etc/specd/specd.env", "-/etc/specd/specd@%i.env"]
    # the unit's own variables first, then the same ones as specd.service; gRPC off (one port per instance)
    assert svc("Environment") == ["SPECD_GRPC_PORT=0", *s[("Service", "Environment")]]
    assert svc("User") == ["specd"] and svc("DynamicUser") == ["yes"], "one dynamic user shares the directories"
    assert "%i" in t[("Unit", "Description")][0]


def _serve_parser() -> argparse.ArgumentParser:
    from specd.cli import build_parser, subcommand_parser

    return subcommand_parser(build_parser(), "serve")


def _serve_dests() -> set:
    return {a.dest for a in _serve_parser()._actions if a.option_strings and a.dest not in ("help", "config")}


def test_toml_example_names_every_serve_setting(monkeypatch):
    from specd.cli import apply_env_and_toml

    text = TOML_EXAMPLE.read_text()
    active = set(tomllib.loads(text))
    commented = set(re.findall(r"^#\s*([a-z_]+)\s*=", text, re.M))
    dests = _serve_dests()
    assert active <= dests, f"unknown keys in specd.toml.example: {sorted(active - dests)}"
    assert commented <= dests, f"unknown commented keys: {sorted(commented - dests)}"
    missing = sorted(dests - active - commented)
    assert not missing, f"serve settings missing from specd.toml.example: {missing}"
    for k in list(os.environ):
        if k.startswith("SPECD_"):
            monkeypatch.delenv(k)
    a = apply_env_and_toml(_serve_parser(), ["--config", str(TOML_EXAMPLE)], "serve")
    assert a.max_queue == 256 and a.drain_timeout == 30.0 and a.no_adaptive is False
    assert a.target == "/srv/specd/models/target"


def test_env_example_names_every_serve_setting():
    names = set(re.findall(r"^#?\s*(SPECD_[A-Z_]+)=", ENV_EXAMPLE.read_text(), re.M))
    want = {"SPECD_" + d.upper() for d in _serve_dests()}
    assert names <= want, f"unknown variables in specd.env.example: {sorted(names - want)}"
    assert want <= names, f"serve settings missing from specd.env.example: {sorted(want - names)}"
