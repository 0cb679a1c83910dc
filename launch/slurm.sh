#!/usr/bin/env bash
# Train on several GPU nodes of a SLURM cluster: `sbatch` one job of NODES whole nodes,
# inside it `srun` starts one trainer process per node (each drives all of its node's
# GPUs) with JAXRL_DISTRIBUTED=1; one log per node under WORKDIR/logs/.
#
#   CONFIG=configs/gsm8k_grpo_qwen2p5_0p5b.py RUNS_DIR=/shared/runs NODES=4 \
#     launch/slurm.sh submit
#
# Subcommands:
#   submit   sbatch the job (from a shell where `pip install -e ".[cuda]"` is active: the
#            job inherits this environment)
#   check    the job's queue state and the last lines of every node's log
# Options: --dry-run prints every command (sbatch with the srun line it wraps) and runs
# none; --help. Arguments after `--` are passed to the trainer verbatim, after EXTRA_ARGS.
#
# Rollout workers (WORKERS > 0): one heterogeneous job of two components, the trainer
# (component 0: NODES nodes, one process each, as without workers) and WORKERS worker nodes (component 1), one `python -m jaxrl_llm.workers.serve` per
# node on WORKER_PORT. The batch script finds the workers' hosts in SLURM's
# SLURM_JOB_NODELIST_HET_GROUP_1 (scontrol show hostnames) and gives them to the trainer
# as rollout.worker_addresses, in split mode (docs/workers.md). The shared secret is
# JAXRL_WORKER_TOKEN, exported where you submit (the job inherits it; it is on no
# command line). The script goes to sbatch on stdin; its log is WORKDIR/logs/%j-sbatch.log,
# the workers' %j-worker%t.log.
#
# Multi-host init: jax.distributed.initialize() with no arguments reads SLURM_NTASKS,
# SLURM_PROCID and SLURM_STEP_NODELIST (coordinator: the first node, port from the job id).
# JAX would also restrict each process to GPU number SLURM_LOCALID (its one-process-per-GPU
# default); JAX_LOCAL_DEVICE_IDS=0,...,GPUS_PER_NODE-1 gives the one process per node all
# of the node's GPUs. Stop a run with a checkpoint: scancel --signal=TERM JOBID.
set -euo pipefail

# Inputs (environment overrides). Hyperparameters live in configs/; override them with
# EXTRA_ARGS="--config.key=value ..." (quote words with spaces: "--config.x='a b'").
CONFIG=${CONFIG:-}               # required: configs/<experiment>.py
RUNS_DIR=${RUNS_DIR:-}           # required unless WORKDIR is set: on a filesystem every node sees
RUN_NAME=${RUN_NAME:-}           # empty: the config's file name (reruns resume)
WORKDIR=${WORKDIR:-}             # empty: $RUNS_DIR/$RUN_NAME
EXTRA_ARGS=${EXTRA_ARGS:-}       # --config.key=value overrides
NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PARTITION=${PARTITION:-}         # empty: the cluster's default partition
ACCOUNT=${ACCOUNT:-}             # empty: your default account
TIME=${TIME:-}                   # wall-clock limit, e.g. 2-00:00:00; empty: the partition's
SBATCH_FLAGS=${SBATCH_FLAGS:-}   # more sbatch flags, e.g. "--qos=high --constraint=h100"
PYTHON=${PYTHON:-python}
WORKERS=${WORKERS:-0}            # rollout worker nodes (0: the rollout runs in the trainer)
WORKER_GPUS=${WORKER_GPUS:-}     # empty: GPUS_PER_NODE
WORKER_PORT=${WORKER_PORT:-7070}

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=launch/lib.sh
source "$REPO/launch/lib.sh"

LOG_LINES=20
SIGTERM_BEFORE_END_S=300         # SIGTERM this long before TIME runs out: time to checkpoint

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  echo "Usage: launch/slurm.sh [--dry-run] submit|check [-- ARG...]"
}

resolve() {
  if [[ -z "$RUN_NAME" ]]; then
    [[ -n "$CONFIG" ]] || die "CONFIG is not set (the experiment, e.g. CONFIG=configs/gsm8k_grpo_qwen2p5_0p5b.py)"
    RUN_NAME=$(config_run_name "$CONFIG")
  fi
  check_name RUN_NAME
  if [[ -z "$WORKDIR" ]]; then
    require RUNS_DIR "a directory on a filesystem every node sees, e.g. RUNS_DIR=/shared/runs"
    WORKDIR="$RUNS_DIR/$RUN_NAME"
  fi
  # The job runs in the repository (--chdir), so a relative workdir is made absolute here.
  [[ "$WORKDIR" == /* ]] || WORKDIR="$PWD/$WORKDIR"
  LOGDIR="$WORKDIR/logs"
}

submit() {
  require CONFIG "the experiment, e.g. CONFIG=configs/gsm8k_grpo_qwen2p5_0p5b.py"
  [[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "NODES='$NODES' is not a positive integer"
  [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE='$GPUS_PER_NODE' is not a positive integer"
  local extra more flags device_ids="0" i
  split_words extra "$EXTRA_ARGS"
  extra+=(${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
  for ((i = 1; i < GPUS_PER_NODE; i++)); do device_ids+=",$i"; done
  local step=(srun --kill-on-bad-exit=1 "--output=$LOGDIR/%j-node%t.log"
    env JAXRL_DISTRIBUTED=1 "JAX_LOCAL_DEVICE_IDS=$device_ids"
    "$PYTHON" -m jaxrl_llm.train "--config=$CONFIG" "--workdir=$WORKDIR"
    ${extra[@]+"${extra[@]}"})
  # Whole nodes (--exclusive, --mem=0): the step gets every CPU of its node, which the
  # trainer's verifier pool uses.
  flags=("--job-name=$RUN_NAME" "--nodes=$NODES" --ntasks-per-node=1
    "--gres=gpu:$GPUS_PER_NODE" --exclusive --mem=0
    "--signal=TERM@$SIGTERM_BEFORE_END_S" "--chdir=$REPO" "--output=$LOGDIR/%j-sbatch.log")
  [[ -z "$PARTITION" ]] || flags+=("--partition=$PARTITION")
  [[ -z "$ACCOUNT" ]] || flags+=("--account=$ACCOUNT")
  [[ -z "$TIME" ]] || flags+=("--time=$TIME")
  split_words more "$SBATCH_FLAGS"
  flags+=(${more[@]+"${more[@]}"})
  run mkdir -p "$LOGDIR"
  if ((WORKERS > 0)); then
    submit_with_workers "$device_ids" "${extra[@]+"${extra[@]}"}"
    return
  fi
  run sbatch "${flags[@]}" "--wrap=$(shquote "${step[@]}")"
}

# submit_with_workers EXTRA...: the heterogeneous job of a trainer and WORKERS workers.
submit_with_workers() {
  local device_ids=$1
  shift
  require JAXRL_WORKER_TOKEN "the workers' shared secret, e.g. export JAXRL_WORKER_TOKEN=\$(openssl rand -hex 16)"
  [[ "$WORKER_PORT" =~ ^[1-9][0-9]*$ ]] || die "WORKER_PORT='$WORKER_PORT' is not a port number"
  local gpus=${WORKER_GPUS:-$GPUS_PER_NODE} common=() more worker train script flag
  [[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "WORKER_GPUS='$gpus' is not a positive integer"
  [[ -z "$PARTITION" ]] || common+=("--partition=$PARTITION")
  [[ -z "$ACCOUNT" ]] || common+=("--account=$ACCOUNT")
  [[ -z "$TIME" ]] || common+=("--time=$TIME")
  split_words more "$SBATCH_FLAGS"
  common+=(${more[@]+"${more[@]}"})
  worker=$(shquote srun --het-group=1 "--output=$LOGDIR/%j-worker%t.log" \
    "$PYTHON" -m jaxrl_llm.workers.serve "--config=$CONFIG" --host=0.0.0.0 "--port=$WORKER_PORT" "$@")
  train=$(shquote srun --het-group=0 --kill-on-bad-exit=1 "--output=$LOGDIR/%j-node%t.log" \
    env JAXRL_DISTRIBUTED=1 "JAX_LOCAL_DEVICE_IDS=$device_ids" "$PYTHON" -m jaxrl_llm.train "--config=$CONFIG" "--workdir=$WORKDIR" "$@" \
    --config.rollout.mode=split "--config.rollout.workers=$WORKERS")
  script="#!/bin/bash"
  for flag in "--job-name=$RUN_NAME" "--signal=TERM@$SIGTERM_BEFORE_END_S" "--chdir=$REPO" \
    "--output=$LOGDIR/%j-sbatch.log" "--nodes=$NODES" --ntasks-per-node=1 "--gres=gpu:$GPUS_PER_NODE" \
    --exclusive --mem=0 ${common[@]+"${common[@]}"} hetjob "--nodes=$WORKERS" \
    --ntasks-per-node=1 "--gres=gpu:$gpus" --exclusive --mem=0 ${common[@]+"${common[@]}"}; do
    script+=$'\n'"#SBATCH $flag"
  done
  # In the job: the worker nodes from SLURM, the workers in the background, the trainer;
  # when it ends the script ends, and SLURM ends the workers' step with the job.
  script+="
set -euo pipefail
addresses=''
for host in \$(scontrol show hostnames \"\$SLURM_JOB_NODELIST_HET_GROUP_1\"); do
  addresses+=\"\${addresses:+,}\$host:$WORKER_PORT\"
done
$worker &
$train \"--config.rollout.worker_addresses=\$addresses\""
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%s <<'\''EOF'\''\n%s\nEOF\n' sbatch "$script"
  else
    printf '+ sbatch (the heterogeneous job script of launch/slurm.sh --dry-run submit, on stdin)\n' >&2
    sbatch <<<"$script"
  fi
}

check() {
  local logs=() log
  run squeue "--name=$RUN_NAME" "--user=$(id -un)" --format='%.12i %.9T %.10M %.6D %R'
  for log in "$LOGDIR"/*-node*.log; do
    [[ ! -e "$log" ]] || logs+=("$log")
  done
  if ((${#logs[@]})); then
    run tail -n "$LOG_LINES" "${logs[@]}"
  else
    note "no node logs in $LOGDIR yet"
  fi
}

main() {
  parse_common "$@"
  set -- ${ARGS[@]+"${ARGS[@]}"}
  (($#)) || {
    usage >&2
    exit 2
  }
  local subcommand=$1
  shift
  TRAIN_ARGS=()
  if (($#)); then
    [[ "$1" == -- ]] || die "unexpected argument '$1' (trainer arguments go after --)"
    shift
    TRAIN_ARGS=("$@")
  fi
  resolve
  case "$subcommand" in
    submit) submit ;;
    check) check ;;
    *) die "unknown subcommand '$subcommand' (submit|check)" ;;
  esac
}

main "$@"
