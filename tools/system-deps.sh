#!/usr/bin/env bash
# What `make` needs from the system beyond pip, installed when that needs no password, or a stop at once
# with the command to run. Called by the Makefile; safe to run again (it only checks once things exist).
#
#   tools/system-deps.sh venv      $PYTHON can create a virtual environment (Debian: python3-venv)
#   tools/system-deps.sh browser   a Chromium for the browser test: Debian's /usr/bin/chromium, or the
#                                  one `playwright install chromium` puts in playwright's cache
#
# apt is used only as root or through passwordless sudo (`sudo -n`); it never prompts. Environment:
# PYTHON (default python3), VENV_PY (default .venv/bin/python), CHROMIUM (default /usr/bin/chromium),
# OS_RELEASE (default /etc/os-release; the tests point it elsewhere).
set -euo pipefail

PYTHON=${PYTHON:-python3}
VENV_PY=${VENV_PY:-.venv/bin/python}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
OS_RELEASE=${OS_RELEASE:-/etc/os-release}

may_use_root() {
  [ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

# apt_install PACKAGE: install it with apt if apt exists, we may use root, and apt has a candidate.
apt_install() {
  command -v apt-get >/dev/null 2>&1 && may_use_root || return 1
  echo "system-deps: apt-get install $1" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || return 1
  local candidate
  candidate=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}')
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    echo "system-deps: apt has no package $1 here" >&2
    return 1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}

os_id() {
  (. "$OS_RELEASE" 2>/dev/null && echo "${ID:-unknown}") || echo unknown
}

stop() {  # stop WHAT COMMAND...
  local what=$1
  shift
  {
    echo "error: $what"
    echo "Run this, then run make again:"
    for command in "$@"; do echo "    $command"; done
  } >&2
  exit 1
}

has_venv() {
  "$PYTHON" -c "import ensurepip, venv" >/dev/null 2>&1
}

has_chromium() {
  # Runs, not just exists: Ubuntu's apt "chromium" can be a stub that needs snapd.
  [ -x "$CHROMIUM" ] && "$CHROMIUM" --version >/dev/null 2>&1 && return 0
  # playwright's own Chromium, if someone ran `playwright install chromium` for this venv's playwright.
  [ -x "$VENV_PY" ] && "$VENV_PY" - >/dev/null 2>&1 <<'PY'
import os, sys
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    sys.exit(0 if os.path.exists(p.chromium.executable_path) else 1)
PY
}

case "${1:-}" in
  venv)
    has_venv && exit 0
    if apt_install python3-venv && has_venv; then exit 0; fi
    stop "$PYTHON cannot create a virtual environment (its venv/ensurepip modules are missing)." \
      "sudo apt-get install -y python3-venv"
    ;;
  browser)
    has_chromium && exit 0
    if apt_install chromium && has_chromium; then exit 0; fi
    if [ "$(os_id)" = debian ]; then
      why="installing it needs root"
      may_use_root && why="apt-get did not install it (see above)"
      stop "the browser test needs Chromium ($CHROMIUM), and $why." \
        "sudo apt-get update && sudo apt-get install -y chromium"
    fi
    stop "the browser test needs Chromium: there is no $CHROMIUM and no Debian chromium package to install." \
      "$VENV_PY -m playwright install --with-deps chromium"
    ;;
  *)
    echo "usage: $0 venv|browser" >&2
    exit 2
    ;;
esac
