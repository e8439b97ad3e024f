#!/usr/bin/env bash
# GRPO with verl's FSDP2 engine, every prompt computed once by sharedprefix (see docs/verl.md).
#   MODEL=Qwen/Qwen3-0.6B TRAIN=~/data/gsm8k/train.parquet VAL=~/data/gsm8k/test.parquet examples/verl_grpo.sh
# Needs verl 0.9.1 (pip install "sharedprefix[verl]") and its rollout engine; any other verl setting can be
# appended as usual (extra arguments are passed on).
set -euo pipefail
: "${MODEL:?set MODEL to a model path or hub name}" "${TRAIN:?set TRAIN to a parquet file}" "${VAL:?set VAL to a parquet file}"

export VERL_USE_EXTERNAL_MODULES=sharedprefix.integrations.verl   # every verl process imports it at `import verl`
export SHAREDPREFIX_MAX_TOKENS=${SHAREDPREFIX_MAX_TOKENS:-16384}   # optional: tokens per sharedprefix pass

exec python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$TRAIN" data.val_files="$VAL" \
  data.train_batch_size=64 data.max_prompt_length=2048 data.max_response_length=1024 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_fused_kernels=False \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.use_prefix_grouper=True \
  actor_rollout_ref.actor.use_dynamic_bsz=True \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 \
  "$@"
