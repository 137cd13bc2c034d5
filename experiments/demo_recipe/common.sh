# Shared by run.sh and run_stale.sh (sourced): the settings, the recipe every arm shares and how an arm runs.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
UNISON=${UNISON:-unison}
OUT=${OUT:-runs/demo_recipe}
SEEDS=${SEEDS:-0,1,2,3,4,5}
PAR=${PAR:-2}
STEPS=${STEPS:-30}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
base() {  # base SFT_STEPS: the recipe every arm shares (unison/demo.py COLLAPSE_RECIPE, steps and LR aside)
  echo --max-prompts 64 --precisions fp32 --seeds "$SEEDS" \
    --set task.name=scratchpad --set task.operands=7 --set task.digits=2 --set task.style=full \
    --set task.train_size=600 --set task.eval_size=200 --set rollout.max_new_tokens=96 --set "sft.steps=$1" \
    --set "train.steps=$STEPS" --set train.prompts_per_step=16 --set rollout.n=8 --set train.mini_batches=4 \
    --set train.micro_batch_size=64 --set train.micro_batch_tokens=null
}
arm() {  # arm NAME SFT_STEPS ARGS...: one arm on the warm start of SFT_STEPS (run.sh makes it), every seed
  local name=$1 sft=$2; shift 2
  local d="$OUT/$name"
  mkdir -p "$d"
  [ -e "$d/sft" ] || { cp -r "$OUT/warm-sft$sft/sft" "$d/sft"; cp "$OUT/warm-sft$sft/perfectible.jsonl" "$d/"; }
  # shellcheck disable=SC2046
  $UNISON sanity --out "$d" $(base "$sft") "$@" > "$d/log.txt" 2>&1 || { echo "arm $name failed: $d/log.txt"; return 1; }
  echo "arm $name done"
}
