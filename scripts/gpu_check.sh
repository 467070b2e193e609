#!/usr/bin/env bash
# The device check, for a machine with a GPU whose image has python3 with CUDA torch, numpy,
# typer, rich, prometheus-client and pytest (nothing is installed there). Runs the CUDA worker
# tests, the cleanup contract and the engine tests, then real bring-ups with CUDA KV tensors.
# Results go to $OUT (or /tmp/gpu-check).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import sys, torch, typer; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'typer', typer.__version__)"
python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/cpu/test_worker.py tests/bringup/test_cleanup_contract.py tests/bringup/test_engine.py \
    2>&1 | tee "$OUT/pytest.log" | tail -n 15
C='{"kv_connector":"OffloadingConnector","kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":4294967296,"secondary_tiers":[{"type":"example"}]}}'
python3 -m shmctl init --kv-transfer-config "$C" --model llama-3-8b --world-size 2 --json >"$OUT/init.json"
echo "init (4 GiB, world 2) exit $?"
python3 - "$OUT/init.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("device", r["device"], "verdict", r["verdict"], "duration_s", round(r["duration_s"], 2))
for s in r["stages"]:
    print(f"  {s['participant']:<10} {s['name']:<16} {s['seconds']:.3f}s {s['bytes'] or 0:>12} {s['result']}")
PY
python3 -m shmctl init --kv-transfer-config "$C" --model llama-3-8b --world-size 2 --fail-at worker --rank 1 --fail-mode oserror:EFAULT >"$OUT/fail.txt" 2>&1
echo "fault at worker on rank 1: exit $? (0 = contract held)"
tail -n 3 "$OUT/fail.txt"
shopt -s nullglob
left=(/dev/shm/vllm_offload_*)
echo "region files left in /dev/shm: ${#left[@]}"
