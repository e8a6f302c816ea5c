#!/usr/bin/env bash
# The whole test suite: set-up (first run only), then pytest. Multi-process tests (gloo via the
# deepspeed launcher, MPI via mpiexec) are spawned by pytest itself with timeouts.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
cd "$REPO"
# with no path among the arguments pytest collects testpaths (all of tests/); a path narrows the run
exec python -m pytest -q -p no:cacheprovider --timeout 900 -o testpaths=tests "$@"
