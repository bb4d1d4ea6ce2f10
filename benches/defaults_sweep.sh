#!/bin/sh
# The defaults sweep: learning rate × momentum for every strategy on every preset, at one budget
# of examples per preset, to choose each strategy's defaults by one rule that keeps every preset
# near its best (docs/decisions/defaults.md). Every distributed run has 4 workers (the parameter
# server one more node, its server); all-reduce stands for the parameter server's BSP too (both
# are large-batch SGD, equal by the oracle tests).
#
# SGD presets (mlp, cnn, mlp-deep): the learning rate at LR_SCALES × the strategy's default
# (0.01, or 0.01 × 4 for 4 data-parallel workers: linear scaling) and momentum at MOMENTA, one
# epoch; plus the run on the strategy's own defaults (no --lr, no --momentum). The language
# model (gpt-cpu, AdamW): the learning rate at GPT_LR_SCALES × 1e-3 and the defaults' run, on
# GPT_WINDOWS training windows. Writes $OUT/results.jsonl (one line a run: strategy, model,
# lr, momentum, whether the defaults chose them, final and best test accuracy or validation
# loss, samples/s) and $OUT/table.md (benches/defaults_table.py); every run's output stays
# under $OUT/runs/ (git-ignored). A rerun keeps the runs that finished. About 50 minutes on
# 2 cores for the whole sweep.
#
#   benches/defaults_sweep.sh
#   STRATEGIES="ps:ssp:2 ring" MODELS=mlp benches/defaults_sweep.sh
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
OUT=${OUT:-docs/reports/defaults-sweep}
STRATEGIES=${STRATEGIES:-local allreduce dpsgd adpsgd ps:ssp:2 ps:asp ps:dssp:1:4 ring}
MODELS=${MODELS:-mlp cnn mlp-deep gpt-cpu}
LR_SCALES=${LR_SCALES:-0.5 1 2}
MOMENTA=${MOMENTA:-0.3 0.6 0.9}
GPT_LR_SCALES=${GPT_LR_SCALES:-1 2 4}
GPT_WINDOWS=${GPT_WINDOWS:-24000}
mkdir -p "$OUT/runs"
results="$OUT/results.jsonl"
touch "$results"

# run STRATEGY MODEL LR MOMENTUM: one training run ("-" leaves the option to the defaults).
run() {
    strategy=$1 model=$2 lr=$3 momentum=$4
    name=$(echo "$strategy-$model-lr$lr-m$momentum" | tr ':' '_')
    dir="$OUT/runs/$name"
    if [ -f "$dir/summary.json" ]; then
        return
    fi
    case $strategy in
        local) placement="--strategy local" ;;
        ps:*) placement="--strategy ps --nodes 5 --servers 1 --consistency ${strategy#ps:}" ;;
        *) placement="--strategy $strategy --nodes 4" ;;
    esac
    case $model in
        gpt-cpu) length="--dataset text --train-samples $GPT_WINDOWS --eval-every 0 --eval-tokens 8192" ;;
        *) length="--epochs 1 --eval-every 0" ;;
    esac
    options=""
    [ "$lr" = "-" ] || options="$options --lr $lr"
    [ "$momentum" = "-" ] || options="$options --momentum $momentum"
    # shellcheck disable=SC2086 # the option lists are meant to split
    if ! "$RINGTMP" train $placement --model "$model" $length $options --out "$dir" \
        --overwrite >"$OUT/runs/$name.log" 2>&1; then
        echo "failed: $name (see $OUT/runs/$name.log)" >&2
        return
    fi
    job="$dir/job.json"
    if [ ! -f "$job" ]; then
        # `local` writes no job file: its rate and momentum are the options' or the defaults'.
        job="$dir/options.json"
        case $model in gpt-cpu) dlr=0.004 dm=null ;; *) dlr=0.01 dm=0.9 ;; esac
        echo "{\"lr\": $([ "$lr" = "-" ] && echo $dlr || echo "$lr"), \"optimizer\": {\"momentum\": $([ "$momentum" = "-" ] && echo $dm || echo "$momentum")}}" >"$job"
    fi
    jq -cs --arg strategy "$strategy" --arg name "$name" \
        --argjson defaults "$([ "$lr$momentum" = "--" ] && echo true || echo false)" \
        '.[0] as $s | .[1] as $job |
         {strategy: $strategy, model: $s.model, run: $name, defaults: $defaults,
          lr: $job.lr, momentum: ($job.optimizer.momentum // null), schedule: $job.lr_schedule,
          warmup_steps: ($job.warmup_steps // null), optimizer: $s.optimizer, steps: $s.steps,
          final_accuracy: $s.final_test_accuracy, best_accuracy: $s.best_test_accuracy,
          final_val_loss: ($s.language.final_val_loss // null),
          best_val_loss: ($s.language.best_val_loss // null),
          samples: $s.samples, samples_per_second: $s.samples_per_second}' \
        "$dir/summary.json" "$job" >>"$results"
}

for model in $MODELS; do
    for strategy in $STRATEGIES; do
        run "$strategy" "$model" - -
        case $model in
            gpt-cpu)
                for scale in $GPT_LR_SCALES; do
                    run "$strategy" "$model" "$(echo "$scale * 0.001" | bc -l | sed 's/^\./0./')" -
                done
                ;;
            *)
                case $strategy in
                    local | ring) base=0.01 ;;
                    *) base=0.04 ;;
                esac
                for scale in $LR_SCALES; do
                    for momentum in $MOMENTA; do
                        run "$strategy" "$model" \
                            "$(echo "$scale * $base" | bc -l | sed 's/^\./0./;s/0*$//')" "$momentum"
                    done
                done
                ;;
        esac
    done
done
python3 benches/defaults_table.py "$results" >"$OUT/table.md"
echo "wrote $OUT/table.md"
