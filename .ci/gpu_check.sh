#!/usr/bin/env bash
# All GPU checks in one short run (for a lent CUDA machine; a few minutes):
#   bash .ci/gpu_check.sh            (from the repo root; results under ${OUT:-gpu-results}/)
# 1. the gpu-marked tests (bitsandbytes int8 on CUDA, KV-cache offload with the prefetch stream, offload plan)
# 2. int8 kernel micro-benchmark on CUDA
# 3. bench: reference comparison + memory (CUDA peak allocated) on the embedded model
# 4. scale: flagship-proportioned random DiffusionGemma (~150M, ~1B) on CUDA — localdiff bf16, localdiff int8
#    (bitsandbytes' kernels, from the cuda extra) and the reference in bf16: ms per denoising step against the HBM
#    bound (weight bytes one step reads ÷ the measured copy bandwidth), localdiff/bench/scale_cuda.py
# 5. int4 on CUDA (localdiff/bench/int4_cuda.py): tinygemm / dequantize / bitsandbytes NF4 / int8 exactness and
#    ms at 1-256 rows, the CUDA context's memory next to the plan's 1 GiB reserve; the int4 conversion tests
#    (tests/quant/test_cuda4.py); the flagship's int4 plans at 16 / 24 GiB
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
python3 -m venv .gpu-venv && . .gpu-venv/bin/activate
pip install -q torch==2.13.0 2>&1 | tail -1
pip install -q ".[test,cuda]" 2>&1 | tail -1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-gpu.txt"
python -m localdiff.bench.quant --device cuda 2>&1 | tee "$OUT/quant-bench-cuda.txt"
localdiff bench --quick --only ref,memory --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
python -m localdiff.bench.scale_cuda --sizes 150M,1B --out "$OUT/scale-cuda.json" 2>&1 | tee "$OUT/scale-cuda.txt"
python -m localdiff.bench.int4_cuda --out "$OUT/int4-cuda.json" 2>&1 | tee "$OUT/int4-cuda.txt"
python -m pytest -q -p no:cacheprovider tests/quant/test_cuda4.py tests/quant/test_int4_embedding.py 2>&1 | tee "$OUT/pytest-int4.txt"
for g in 16GiB 24GiB; do
  localdiff show diffusiongemma:26b-a4b --plan --quant int4 --gpu-mem "$g" 2>&1 | sed -n '/^memory plan/,$p' | tee "$OUT/plan-int4-$g.txt"
done
