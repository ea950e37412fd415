#!/usr/bin/env bash
# Set up everything the tests need on a fresh machine and run the whole test suite.
# PostgreSQL: the tests start a throwaway server of their own from the installed binaries;
# Debian's postgresql package is installed here when they are missing (needs root), and so is
# Debian's chromium, for the console's tests in a real browser.
set -euo pipefail
cd "$(dirname "$0")/.."

have_pg() {
  command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
}
# The console's browser tests (tests/test_console_browser.py) drive Debian's chromium with
# Playwright; no browser is downloaded. Installed here when it is missing (needs root).
missing=()
have_pg || missing+=(postgresql)
[ -x /usr/bin/chromium ] || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# PYTHON and VENV choose another interpreter and its own environment, e.g.
# PYTHON=python3.13 VENV=.venv-3.13 bash scripts/test.sh
venv="${VENV:-.venv}"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e '.[test]'
"$venv/bin/python" -m pytest "$@"
