#!/usr/bin/env bash
# The GPU checks of docs/distributed.md, as one short script for a CUDA machine (not run on the CPU
# development machines). It needs lmforge installed with a CUDA torch. Each check prints PASS/FAIL:
#   1. SFT, FSDP2 + bf16 (mixed-precision policy), 1 GPU and 2 GPUs (NCCL) if there are two;
#   2. the same global batch on 1 and 2 GPUs gives close losses (bf16: loose bound);
#   3. exact resume on the same GPU count;
#   4. GRPO with FSDP2 + bf16 and the bf16 sampler copy.
#   bash benchmarks/gpu_check.sh [OUT_DIR]       (PYTHON=... picks the interpreter; default python3)
set -uo pipefail
out=${1:-runs/gpu_check}
rm -rf "$out"; mkdir -p "$out"
# One interpreter for every step, the one that has torch: CUDA images often have python3 and no python,
# and a torchrun on PATH may belong to another environment.
py=${PYTHON:-python3}
ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())") || { echo "[gpu_check] $py cannot import torch"; exit 2; }
if [ "${ngpu:-0}" -lt 1 ]; then echo "[gpu_check] no CUDA device visible to $py"; exit 2; fi
torchrun() { "$py" -m torch.distributed.run "$@"; }
python() { "$py" "$@"; }
echo "[gpu_check] $("$py" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))') x $ngpu"
tiny="model.name=tiny:llama model.tokenizer=char model.hidden_size=256 model.num_layers=4 model.num_heads=4 model.max_position_embeddings=64"
sft="$tiny data.task=addition data.max_len=32 data.num_eval=64 train.batch_size=64 train.micro_batch_size=16 train.max_steps=40 train.eval_every=20 train.save_every=20 train.keep_last=5 train.dtype=bf16 train.device=cuda parallel.strategy=fsdp2 logging.progress=false"
status=0
check() { if "$@"; then echo "PASS $*" | cut -c1-160; else echo "FAIL $*" | cut -c1-160; status=1; fi; }
losses() { python -c "import json,sys; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; print(' '.join(f\"{x['loss']:.4f}\" for x in r if x['kind']=='train'))"; }
check torchrun --nproc_per_node=1 -m lmforge sft $sft train.output_dir="$out/sft1"
if [ "$ngpu" -ge 2 ]; then
  check torchrun --nproc_per_node=2 -m lmforge sft $sft train.output_dir="$out/sft2"
  check python - "$out" <<'PY'
import json, sys
def L(p): return [r["loss"] for r in map(json.loads, open(p)) if r["kind"] == "train"]
a, b = L(sys.argv[1] + "/sft1/metrics.jsonl"), L(sys.argv[1] + "/sft2/metrics.jsonl")
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"1 vs 2 GPUs, bf16: worst relative loss difference {worst:.2e}")
sys.exit(worst > 5e-2)
PY
fi
mkdir -p "$out/resumed/checkpoints" && cp -r "$out/sft1/checkpoints/step-000020" "$out/resumed/checkpoints/"
check torchrun --nproc_per_node=1 -m lmforge sft $sft train.output_dir="$out/resumed" train.resume=auto
check python - "$out" <<'PY'
import json, sys
def L(p): return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r["kind"] == "train"}
a, b = L(sys.argv[1] + "/sft1/metrics.jsonl"), L(sys.argv[1] + "/resumed/metrics.jsonl")
same = all(a[s] == b[s] for s in b)
print(f"resume steps {min(b)}-{max(b)} identical: {same}")
sys.exit(not same)
PY
check torchrun --nproc_per_node="$ngpu" -m lmforge grpo $tiny data.task=addition data.num_eval=32 rollout.num_prompts=8 rollout.group_size=8 rollout.max_new_tokens=6 rollout.dtype=bf16 algo.is_level=token train.max_steps=5 train.dtype=bf16 train.device=cuda parallel.strategy=fsdp2 logging.progress=false train.output_dir="$out/grpo"
echo "[gpu_check] $( [ $status = 0 ] && echo all passed || echo FAILURES )"
exit $status
