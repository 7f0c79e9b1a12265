#!/usr/bin/env bash
# Runs the benchmarks on one accelerator host within a time budget (benchmarks/accelerator.py;
# its docstring has the options). `--smoke` runs everything CPU-sized in under a minute.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .venv/bin/python ]; then
  python=.venv/bin/python
else
  python=python3
fi
exec "$python" benchmarks/accelerator.py "$@"
