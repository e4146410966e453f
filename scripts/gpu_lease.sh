#!/usr/bin/env bash
# One lent GPU call (about 15 minutes of device time a task, 10 minutes a call): the `gpu`
# tests in parallel, the launch count (one sequence's step and a batch of four's), attention at 32K-128K and the whole Llama-3.1-8B-shaped
# decode with CUDA graphs (T_ATTN_EAGER > 0 adds attention with the segments left eager, which
# compiles nothing; T_BATCH > 0 the batched decode at 8K, batches of 1 and 4, T_BATCH_GRAPHS > 0
# the same with each batch step replayed as a CUDA graph), each step under
# its own time limit (0 skips it) so one slow step cannot starve the rest. Results: one
# archive, $OUT/gpu.tar.gz (the tool brings back at most 8 files), and $OUT/summary.txt. The
# machine is offline: hydra, omegaconf, antlr4 and gguf travel as wheels.
#   device run, carry [".whl"]:  bash scripts/gpu_lease.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; R=$OUT/bench; mkdir -p "$R/graphs"
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=python3
step() {  # step SECONDS NAME COMMAND...: run, log to $R/NAME.txt, record rc and seconds
  local limit=$1 name=$2; shift 2; local t0=$SECONDS
  (( limit > 0 )) || return 0  # a limit of 0 skips the step
  timeout -s INT -k 15 "$limit" "$@" >"$R/$name.txt" 2>&1; local rc=$?
  echo "$name: rc $rc, $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head; } >"$R/machine.txt" 2>&1
SKIP=()
$PY -c "import wandb" 2>/dev/null || SKIP+=(--ignore=tests/test_hygiene.py)
$PY -c "import lm_eval" 2>/dev/null || SKIP+=(--ignore=tests/integrations/test_lm_eval.py)
# -v: each test's outcome as it finishes, so a step cut by its limit still says which passed;
# the files no lease has finished yet go first (GPU_FIRST): test_gpu.py's device steps now run
# the selection, page-in, certificate and rung kernels (issue 55) that no GPU has run yet
GPU_FIRST=${GPU_FIRST:-"tests/test_gpu.py tests/test_attention_batch.py tests/test_faults.py \
tests/test_tiers_contract.py tests/evict/test_summary.py"}
# the tests' many small shapes at the default launch configuration (no tuning time; the
# benches below tune Phase 1 and 2 and list what they kept: certkv/kernels/triton_tune.py)
step ${T_TESTS:-180} gpu_tests env CERTKV_AUTOTUNE=0 $PY -m pytest -m gpu -p no:cacheprovider \
  -n 8 --dist load \
  --timeout 170 --durations=25 -v -rfE "${SKIP[@]}" $GPU_FIRST tests
step ${T_LAUNCH:-80} launches $PY -m certkv.cli bench launches --batch 4 --out "$R" --force
step ${T_ATTN_EAGER:-0} attention_eager $PY -m certkv.cli bench attention --context 32768 \
  --context 65536 --context 131072 --repeats 10 --compile off --out "$R/eager_segments" --force
step ${T_ATTN:-120} attention $PY -m certkv.cli bench attention --context 32768 --context 65536 \
  --context 131072 --repeats 10 --out "$R" --force
step ${T_DECODE:-130} decode_graphs $PY -m certkv.cli bench decode --model llama31_8b \
  --context 8192 --context 32768 --context 65536 --repeats 3 --graphs on --out "$R/graphs" --force
step ${T_BATCH:-0} decode_batch $PY -m certkv.cli bench decode --model llama31_8b --context 8192 \
  --batch 1,4 --repeats 3 --out "$R/batch" --force
step ${T_BATCH_GRAPHS:-0} decode_batch_graphs $PY -m certkv.cli bench decode --model llama31_8b \
  --context 8192 --batch 1,4 --repeats 3 --graphs on --out "$R/batch_graphs" --force
tar -czf "$OUT/gpu.tar.gz" -C "$OUT" bench
{ cat "$R/machine.txt" "$R/steps.txt"; tail -5 "$R/gpu_tests.txt"; } >"$OUT/summary.txt"
cat "$OUT/summary.txt"
