#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The venv's tools (gds-check, hadolint, shellcheck) are what the tests run.
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
