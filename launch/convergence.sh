#!/usr/bin/env bash
# Convergence sweep: dense vs DRAGONN and the baselines on the classifier and the LM, 2 ranks,
# through the deepspeed launcher. Writes convergence.{json,md,png} under --out (default docs/results/convergence).
#   bash launch/convergence.sh            # the default sweep (under 45 min on 2 CPU cores)
#   bash launch/convergence.sh --quick    # a short sweep (under 5 min), runs/convergence_quick
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$REPO/launch/setup_env.sh"
cd "$REPO"
exec python launch/convergence.py "$@"
