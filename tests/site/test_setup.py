"""`make test` on a fresh machine: the system packages it needs are installed, or it stops at once.

tools/system-deps.sh runs against fake `id`, `sudo`, `apt-get` and `apt-cache` placed first on PATH, so
each test plays one kind of machine (root or not, Debian or Ubuntu) without touching this one.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.site._site_docs import REPO

pytestmark = pytest.mark.site

SCRIPT = REPO / "tools" / "system-deps.sh"


def fake_machine(tmp_path: Path, *, uid: int, sudo_ok: bool, candidate: str | None, os_id: str = "debian"):
    """A bin folder of fakes; apt-get logs its calls and 'installs' chromium by creating the file."""
    bin_dir, chromium = tmp_path / "bin", tmp_path / "usr-bin-chromium"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    fakes = {
        "id": f'[ "$1" = -u ] && echo {uid} || echo "uid={uid}"',
        "sudo": ('[ "$1" = -n ] && shift; [ "$1" = true ] && exit 0; exec "$@"' if sudo_ok else "exit 1"),
        "apt-get": f'echo "$*" >> {log}; case "$*" in *install*chromium*) '
        f'printf "#!/bin/sh\\n" > {chromium}; chmod +x {chromium};; esac',
        "apt-cache": f'echo "  Candidate: {candidate}"' if candidate else "exit 100",
    }
    for name, body in fakes.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    os_release = tmp_path / "os-release"
    os_release.write_text(f"ID={os_id}\n")
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        CHROMIUM=str(chromium),
        VENV_PY=str(tmp_path / "no-venv" / "python"),  # no playwright-managed Chromium either
        OS_RELEASE=str(os_release),
    )
    return env, chromium, log


def run_script(env, what: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), what], env=env, capture_output=True, text=True, timeout=60)


def test_chromium_already_there_needs_nothing(tmp_path):
    env, chromium, log = fake_machine(tmp_path, uid=1000, sudo_ok=False, candidate=None)
    chromium.write_text("#!/bin/sh\n")
    chromium.chmod(0o755)
    proc = run_script(env, "browser")
    assert proc.returncode == 0, proc.stderr
    assert not log.exists(), "apt ran although chromium was there"


def test_a_chromium_that_does_not_run_counts_as_missing(tmp_path):
    env, chromium, _ = fake_machine(tmp_path, uid=1000, sudo_ok=False, candidate=None, os_id="ubuntu")
    chromium.write_text("#!/bin/sh\necho 'chromium needs the snap' >&2\nexit 1\n")  # Ubuntu's stub, no snapd
    chromium.chmod(0o755)
    proc = run_script(env, "browser")
    assert proc.returncode == 1
    assert "-m playwright install --with-deps chromium" in proc.stderr


@pytest.mark.parametrize("uid, sudo_ok", [(0, False), (1000, True)], ids=["root", "passwordless-sudo"])
def test_debian_chromium_is_installed_with_apt_when_allowed(tmp_path, uid, sudo_ok):
    env, chromium, log = fake_machine(tmp_path, uid=uid, sudo_ok=sudo_ok, candidate="150.0-1~deb12u1")
    proc = run_script(env, "browser")
    assert proc.returncode == 0, proc.stderr
    assert chromium.exists()
    assert "install -y -qq chromium" in log.read_text()


def test_without_root_it_stops_at_once_with_the_apt_command(tmp_path):
    env, chromium, log = fake_machine(tmp_path, uid=1000, sudo_ok=False, candidate="150.0-1~deb12u1")
    proc = run_script(env, "browser")
    assert proc.returncode == 1
    assert "sudo apt-get update && sudo apt-get install -y chromium" in proc.stderr
    assert not log.exists() and not chromium.exists()


def test_without_a_debian_chromium_package_it_names_playwrights_installer(tmp_path):
    env, chromium, log = fake_machine(tmp_path, uid=0, sudo_ok=False, candidate="(none)", os_id="ubuntu")
    proc = run_script(env, "browser")
    assert proc.returncode == 1
    assert "-m playwright install --with-deps chromium" in proc.stderr
    assert "install -y -qq chromium" not in log.read_text()  # it looked, and did not install a snap stub


def test_missing_venv_module_stops_with_the_package_to_install(tmp_path):
    env, _, _ = fake_machine(tmp_path, uid=1000, sudo_ok=False, candidate=None)
    no_venv = tmp_path / "bin" / "python-without-venv"
    no_venv.write_text("#!/bin/sh\nexit 1\n")
    no_venv.chmod(0o755)
    proc = run_script(dict(env, PYTHON=str(no_venv)), "venv")
    assert proc.returncode == 1
    assert "sudo apt-get install -y python3-venv" in proc.stderr


def test_make_test_checks_the_browser_before_the_long_steps():
    """Dry run: the browser check is the first thing after installing, before lint and pytest."""
    proc = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    browser = next(i for i, line in enumerate(lines) if "system-deps.sh browser" in line)
    first_check = next(i for i, line in enumerate(lines) if "ruff check" in line or "pytest" in line)
    assert browser < first_check
    assert "-rA" not in proc.stdout  # passed claims' captured output (torch's logs) is not dumped


@pytest.mark.parametrize(("unit", "site"), [(0, 0), (1, 0), (0, 2)], ids=["both-pass", "unit-fails", "site-fails"])
def test_make_test_runs_the_site_beside_the_unit_tests_and_fails_when_either_fails(tmp_path, unit, site):
    """The recipe of `make test` with its two branches played by a fake sub-make: both run whatever the
    other does, the site's log is shown after the unit tests' output, and the exit status is non-zero
    when either branch failed."""
    fake = tmp_path / "fake-make"
    fake.write_text('#!/bin/sh\ncase "$1" in\n'
                    f'  test-unit) echo "unit output"; exit {unit};;\n'
                    f'  test-site) sleep 0.5; echo "site output"; exit {site};;\n'
                    '  *) echo "unexpected target $1"; exit 9;;\nesac\n')
    fake.chmod(0o755)
    log = tmp_path / "site-steps.log"
    proc = subprocess.run(["make", "--no-print-directory", "-o", "install", "-o", "browser", "-o", "lint", "test",
                           f"SUBMAKE={fake}", f"SITE_LOG={log}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    out = proc.stdout
    assert "unexpected target" not in out + log.read_text()
    assert "unit output" in out and "site output" in out, out
    assert out.index("unit output") < out.index("site output")  # the site's log comes after the unit tests
    assert re.search(rf"^unit tests and claims: \d+ s, exit status {unit}$", out, re.M), out
    assert re.search(rf"^site branch: \d+ s, exit status {site}$", out, re.M), out
    assert re.search(r"^tests after the install: \d+ s$", out, re.M), out
    assert (proc.returncode == 0) == (unit == 0 and site == 0), (proc.returncode, out, proc.stderr)
