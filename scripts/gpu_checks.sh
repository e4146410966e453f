#!/usr/bin/env bash
# Everything issue #4 measures on a GPU, in one go: the `gpu` tests (full-size kernels, the
# contract on CUDA, host syncs), then the attention and whole-model benches. Results land in
# $OUTDIR (default reports/bench/; markdown + JSON + plot, with the device and versions; on the
# lent machine pass OUTDIR=$OUT/bench so they come back; --force: they replace the committed ones). Uses the python on
# PATH (or $PYTHON); the lent GPU machines are offline, so it installs nothing: it needs torch,
# triton, transformers, typer, rich, pytest and hypothesis.
#   bash scripts/gpu_checks.sh            # tests + benches
#   bash scripts/gpu_checks.sh --quick    # tests + 64K attention only
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUTDIR=${OUTDIR:-reports/bench}
mkdir -p "$OUTDIR"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
# test modules that import an optional extra at the top cannot be collected without it (the
# lent machines lack wandb and lm-eval); none of them holds a gpu test
SKIP=()
"$PY" -c "import wandb" 2>/dev/null || SKIP+=(--ignore=tests/test_hygiene.py)
"$PY" -c "import lm_eval" 2>/dev/null || SKIP+=(--ignore=tests/integrations/test_lm_eval.py)
# the tests' many small shapes run at the default launch configuration (no tuning time)
CERTKV_AUTOTUNE=0 "$PY" -m pytest -m gpu -p no:cacheprovider "${SKIP[@]}" tests 2>&1 \
  | tee "$OUTDIR/gpu_tests.txt"
# what a layer step launches on CUDA (Triton launches, segments, eager operators, and the
# CUDA kernels the profiler records): issue 24's launch count, measured on the device
"$PY" -m certkv.cli bench launches --out "$OUTDIR" --force
# ... and one step of a ragged batch of four: six launches over (sequence, kv head, program)
"$PY" -m certkv.cli bench launches --batch 4 --out "$OUTDIR" --force
# ... over the tiers with KVQuant's archive (pre-RoPE keys, dense-and-sparse values)
"$PY" -m certkv.cli bench launches --quantizer tiers:archive=kvquant --context 4104 \
  --out "$OUTDIR" --force
if [[ "${1:-}" == "--quick" ]]; then
  "$PY" -m certkv.cli bench attention --context 65536 --repeats 50 --out "$OUTDIR" --force
  exit
fi
"$PY" -m certkv.cli bench attention --context 32768 --context 65536 --context 131072 \
  --repeats 50 --out "$OUTDIR" --force
"$PY" -m certkv.cli bench decode --model llama31_8b --context 8192 --context 32768 \
  --context 65536 --repeats 10 --out "$OUTDIR" --force
# the same whole-model steps, each decode step captured whole in a CUDA graph (GraphedDecode)
"$PY" -m certkv.cli bench decode --model llama31_8b --context 8192 --context 32768 \
  --context 65536 --repeats 10 --graphs on --out "$OUTDIR/graphs" --force
# A/B: the same 64K attention step with the selection/certificate segments left eager
"$PY" -m certkv.cli bench attention --context 65536 --repeats 50 --compile off \
  --out "$OUTDIR/eager_segments" --force
