#!/usr/bin/env bash
# Runs benchmark and test jobs one after another on a lent GPU machine, from a copy of the
# working tree that carries what tools/gpu_machine_kit.py prepared (lora/v1, .whl, .tok):
#
#   OUT=$OUT bash tools/gpu_jobs.sh 590 "tests@200:python -m pytest -q -m gpu tests/ --continue-on-collection-errors" \
#       "churn:python -m bench.adapters churn --alphas 1.0 --seed 1"
#
# The first argument is the call's deadline in seconds; each job is NAME[@CAP]:COMMAND, run
# with the time left (or CAP seconds, if fewer), its whole output written to $OUT/NAME.txt
# and its tail printed. Jobs run in turn because timings taken side by side on one GPU
# disturb each other. Tuning tables the jobs wrote or changed are copied to $OUT, and
# Triton's cache goes to $OUT/triton-cache.tgz (carry it back as .tcache/ to skip compiles).
set -u
deadline=$1; shift
start=$(date +%s)
mark=$(mktemp)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "could not install .whl/ (run tools/gpu_machine_kit.py and carry .whl)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD LORA_TEST_TOKENIZER_DIR=$PWD/.tok TRITON_CACHE_DIR=/tmp/triton-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton-cache.tgz ] && tar -xzf .tcache/triton-cache.tgz -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for job in "$@"; do
  name=${job%%:*}; cmd=${job#*:}; cap=0
  case $name in *@*) cap=${name#*@}; name=${name%@*};; esac
  left=$(( deadline - ($(date +%s) - start) - 25 ))  # 25 s for the copies at the end
  if [ "$left" -lt 10 ]; then echo "== $name skipped: no time left"; continue; fi
  [ "$cap" -gt 0 ] && [ "$cap" -lt "$left" ] && left=$cap
  t0=$(date +%s)
  # Its own session, so whatever the job started (a tensor-parallel node's ranks) ends with it.
  setsid timeout -k 5 "$left" bash -c "$cmd" > "$OUT/$name.txt" 2>&1 &
  job_pid=$!
  wait "$job_pid"; rc=$?
  kill -KILL -- "-$job_pid" 2>/dev/null; sleep 1
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 30 "$OUT/$name.txt"
done
find kernels/configs -type f -newer "$mark" -exec cp {} "$OUT/" \;
(cd "$TRITON_CACHE_DIR" && tar -czf "$OUT/triton-cache.tgz" .)
