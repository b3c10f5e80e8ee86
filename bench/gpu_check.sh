#!/usr/bin/env bash
# The checks to run on a machine with an NVIDIA GPU, as one command from the repository root:
#     bench/gpu_check.sh OUT_DIR
# 1. the gpu-marked tests of the ROS-free test modules (what `make test-gpu` runs, without its venv, so that a
#    machine with PyTorch but no ROS can run it);
# 2. `gp-mapping bench --only cuda` (engine sweep and replays on the GPU) and, beside it in a second process on
#    another core, `gp-mapping bench --only speed` (the same sweep and replays on the CPU of the same machine),
#    each with its log, JSON and Markdown in OUT_DIR.
# Needs python3 with torch (CUDA build), numpy, scipy, pyyaml, safetensors, tqdm, matplotlib, rosbags, pytest and
# gpytorch, gp_mapping importable (PYTHONPATH=.), and the recordings in $GP_MAPPING_DATA (or ../shared/data).
set -u
out=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$out"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  || { echo "no CUDA device visible to torch"; exit 1; }

timeout "${GPU_BENCH_SECONDS:-420}" python3 -m gp_mapping.cli bench --only speed --out "$out" > "$out/speed.log" 2>&1 &
cpu_bench=$!

# the modules that hold gpu tests (all ROS-free), found rather than listed, so a new one is not missed
timeout "${GPU_TEST_SECONDS:-240}" python3 -m pytest -q -rfEs -m gpu -p no:cacheprovider \
  $(grep -l "pytest.mark.gpu" test/*/test_*.py) 2>&1 | tee "$out/test_gpu.log"
tests=${PIPESTATUS[0]}

timeout "${GPU_BENCH_SECONDS:-420}" python3 -m gp_mapping.cli bench --only cuda --out "$out" > "$out/cuda.log" 2>&1
cuda=$?
wait $cpu_bench
speed=$?
tail -n 30 "$out/cuda.log" "$out/speed.log"
echo "gpu tests exit $tests, cuda bench exit $cuda, speed bench exit $speed"
[ "$tests" -eq 0 ] && [ "$cuda" -eq 0 ] && [ "$speed" -eq 0 ]
