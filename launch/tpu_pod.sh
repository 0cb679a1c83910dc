#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice: every worker runs the same training command and JAX
# joins them into one multi-host program (JAXRL_DISTRIBUTED=1 -> jax.distributed.initialize()
# with no arguments: JAX reads the worker list and its own index from the TPU VM metadata).
#
#   TPU_NAME=rl-pod ZONE=us-east5-a BUCKET=my-bucket CONFIG=configs/math_grpo_llama3_8b_tpu.py \
#     launch/tpu_pod.sh create    # then: setup, run, check (as often as you like), delete
#
# Subcommands (each acts on every worker with --worker=all):
#   create   create the TPU VM slice
#   setup    copy the code (git archive of HEAD) to every worker and pip-install it
#   run      start the trainer on every worker in the background; one log per worker
#   check    per worker: running or exit status, the log's last lines; copies the logs to
#            WORKDIR/logs/
#   stop     send SIGTERM to the trainers (the trainer saves a checkpoint and exits)
#   delete   delete the slice (gcloud asks for confirmation)
# Options: --dry-run prints every command and runs none; --help. Arguments after `--` are
# passed to the trainer verbatim, after EXTRA_ARGS.
#
# Rollout workers: WORKER_TPUS="rl-w0 rl-w1" names TPU VMs or slices (each made and set
# up with this script: TPU_NAME=rl-w0 ACCELERATOR_TYPE=v5p-8 ... create, then setup), one
# worker each: `python -m jaxrl_llm.workers.serve` on every host of it, one JAX world
# (JAXRL_DISTRIBUTED=1), its host 0 listening on WORKER_PORT. `run` starts them first, then
# the trainer (on every host of TPU_NAME), in split mode, with the workers'
# internal IPs, which the trainer's host asks the TPU API for at start (`gcloud compute
# tpus tpu-vm describe`, as the VMs' service account). The shared secret is the newest
# version of the Secret Manager secret WORKER_TOKEN_SECRET, read on each VM (never on a
# command line here). check and stop act on the workers too.
set -euo pipefail

# Inputs (environment overrides). Hyperparameters live in configs/; override them with
# EXTRA_ARGS="--config.key=value ..." (quote words with spaces: "--config.x='a b'").
TPU_NAME=${TPU_NAME:-}                 # required: the TPU VM (slice) name
ZONE=${ZONE:-}                         # required: e.g. us-east5-a
PROJECT=${PROJECT:-}                   # empty: gcloud's configured project
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v5p-64}
RUNTIME_VERSION=${RUNTIME_VERSION:-}   # empty: the TPU software version for ACCELERATOR_TYPE
CREATE_FLAGS=${CREATE_FLAGS:-}         # more `tpu-vm create` flags, e.g. "--spot"
BUCKET=${BUCKET:-}                     # required by run: the GCS bucket holding the workdir
CONFIG=${CONFIG:-}                     # required by run: configs/<experiment>.py
RUN_NAME=${RUN_NAME:-}                 # empty: the config's file name (reruns resume)
WORKDIR=${WORKDIR:-}                   # empty: gs://$BUCKET/runs/$RUN_NAME
EXTRA_ARGS=${EXTRA_ARGS:-}             # --config.key=value overrides
PYTHON=${PYTHON:-python3}              # the workers' interpreter (a venv's python works too)
WORKER_TPUS=${WORKER_TPUS:-}           # rollout worker TPU VMs, space-separated (empty: none)
WORKER_PORT=${WORKER_PORT:-7070}
WORKER_TOKEN_SECRET=${WORKER_TOKEN_SECRET:-jaxrl-worker-token}  # in Secret Manager

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=launch/lib.sh
source "$REPO/launch/lib.sh"

REMOTE_DIR=jaxrl_llm                   # the code, relative to each worker's home
LOG_LINES=20
# Runs on the worker as `bash -c "$WRAPPER" LOG CMD...`: expands there, not here.
# shellcheck disable=SC2016
WRAPPER='"$@" & echo $! > "$0.pid"; wait $!; echo $? > "$0.rc"'

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  echo "Usage: launch/tpu_pod.sh [--dry-run] create|setup|run|check|stop|delete [-- ARG...]"
}

default_runtime_version() {
  case "$ACCELERATOR_TYPE" in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) echo tpu-ubuntu2204-base ;;
    *) die "no default RUNTIME_VERSION for ACCELERATOR_TYPE=$ACCELERATOR_TYPE; set it" ;;
  esac
}

# gcloud_tpu VERB [ARG...]: `gcloud compute tpus tpu-vm VERB` on this slice's zone/project.
gcloud_tpu() {
  local verb=$1
  shift
  local flags=("--zone=$ZONE")
  [[ -z "$PROJECT" ]] || flags+=("--project=$PROJECT")
  run gcloud compute tpus tpu-vm "$verb" "$@" "${flags[@]}"
}

# on_all_workers SCRIPT: runs a shell script on every worker of the slice.
on_all_workers() {
  gcloud_tpu ssh "$TPU_NAME" --worker=all "--command=$1"
}

# on_rollout_workers SCRIPT: runs a shell script on every host of each rollout worker.
on_rollout_workers() {
  local name
  for name in $WORKER_TPUS; do
    gcloud_tpu ssh "$name" --worker=all "--command=$1"
  done
}

# start_script ENV COMMAND: the remote script that starts COMMAND (shell-quoted) in the
# background with ENV assignments before it, one log per host.
start_script() {
  # `bash -c WRAPPER LOG CMD...` records the pid and exit status beside the log ($0 is the
  # log's path); setsid + nohup keep it alive after ssh disconnects.
  printf '%s' "$LOG_VARS; mkdir -p \"\$(dirname \"\$log\")\"; \
if $ALIVE; then echo \"\$(hostname): already running, see \$log\" >&2; exit 1; fi; \
cd $REMOTE_DIR || exit 1; rm -f \"\$log.pid\" \"\$log.rc\"; \
$1 setsid nohup bash -c $(shquote "$WRAPPER") \"\$log\" $2 \
> \"\$log\" 2>&1 < /dev/null & echo \"\$(hostname): started, log \$log\""
}

resolve_run() {
  if [[ -z "$RUN_NAME" ]]; then
    [[ -n "$CONFIG" ]] || die "RUN_NAME is not set (nor CONFIG, whose file name is its default)"
    RUN_NAME=$(config_run_name "$CONFIG")
  fi
  check_name RUN_NAME
  # Each worker's log: ~/jaxrl_llm_logs/RUN_NAME/<hostname>.log (+ .pid, .rc beside it).
  LOG_VARS="log=\"\$HOME/jaxrl_llm_logs/$RUN_NAME/\$(hostname).log\""
  ALIVE="[ -f \"\$log.pid\" ] && kill -0 \"\$(cat \"\$log.pid\")\" 2>/dev/null"
}

resolve_workdir() {
  if [[ -z "$WORKDIR" ]]; then
    require BUCKET "the GCS bucket for the run's workdir, e.g. BUCKET=my-bucket"
    WORKDIR="gs://${BUCKET#gs://}/runs/$RUN_NAME"
  fi
}

cmd_create() {
  [[ -n "$RUNTIME_VERSION" ]] || RUNTIME_VERSION=$(default_runtime_version)
  local extra
  split_words extra "$CREATE_FLAGS"
  gcloud_tpu create "$TPU_NAME" "--accelerator-type=$ACCELERATOR_TYPE" \
    "--version=$RUNTIME_VERSION" ${extra[@]+"${extra[@]}"}
}

cmd_setup() {
  local tarball="${TMPDIR:-/tmp}/$TPU_NAME-jaxrl_llm.tar.gz"
  if [[ "$DRY_RUN" != 1 ]] && ! git -C "$REPO" diff --quiet HEAD --; then
    note "uncommitted changes are not shipped: setup copies the last commit (HEAD)"
  fi
  run git -C "$REPO" archive --format=tar.gz -o "$tarball" HEAD
  gcloud_tpu scp "$tarball" "$TPU_NAME:jaxrl_llm.tar.gz" --worker=all
  on_all_workers "rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR \
&& tar -xzf jaxrl_llm.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR \
&& $(shquote "$PYTHON") -m pip install -q -e '.[tpu]'"
}

cmd_run() {
  require CONFIG "the experiment, e.g. CONFIG=configs/math_grpo_llama3_8b_tpu.py"
  resolve_run
  resolve_workdir
  local extra train env=JAXRL_DISTRIBUTED=1 name count=0 token lookup="" flags project
  split_words extra "$EXTRA_ARGS"
  extra+=(${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
  train=$(shquote "$PYTHON" -m jaxrl_llm.train "--config=$CONFIG" "--workdir=$WORKDIR" \
    ${extra[@]+"${extra[@]}"})
  if [[ -n "$WORKER_TPUS" ]]; then
    [[ "$WORKER_PORT" =~ ^[1-9][0-9]*$ ]] || die "WORKER_PORT='$WORKER_PORT' is not a port number"
    check_name WORKER_TOKEN_SECRET
    project=""
    [[ -z "$PROJECT" ]] || project=" --project=$PROJECT"
    flags="--zone=$ZONE$project"
    # Read on each VM when it starts: the token never crosses this machine.
    token="JAXRL_WORKER_TOKEN=\"\$(gcloud secrets versions access latest \
--secret=$WORKER_TOKEN_SECRET$project)\""
    for name in $WORKER_TPUS; do
      [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "WORKER_TPUS: '$name' is not a TPU name"
      count=$((count + 1))
      lookup+="\$(gcloud compute tpus tpu-vm describe $name $flags \
--format='value(networkEndpoints[0].ipAddress)'):$WORKER_PORT "
    done
    on_rollout_workers "$(start_script "JAXRL_DISTRIBUTED=1 $token" "$(shquote "$PYTHON" -m jaxrl_llm.workers.serve \
      "--config=$CONFIG" --host=0.0.0.0 "--port=$WORKER_PORT" ${extra[@]+"${extra[@]}"})")"
    # The workers' addresses, from the TPU API on the trainer's host.
    env="export $token; addresses=\"$lookup\"; addresses=\"\${addresses% }\"; $env"
    train+=" --config.rollout.mode=split --config.rollout.workers=$count"
    train+=" \"--config.rollout.worker_addresses=\${addresses// /,}\""
  fi
  on_all_workers "$(start_script "$env" "$train")"
}

cmd_check() {
  resolve_run
  local copy=""
  if [[ -n "$WORKDIR" || -n "$BUCKET" ]]; then
    resolve_workdir
    [[ "$WORKDIR" != gs://* ]] || copy="; gcloud storage cp \"\$log\" \
$(shquote "$WORKDIR/logs/") > /dev/null 2>&1 || echo \"\$(hostname): could not copy the log\""
  fi
  on_all_workers "$(check_script "$copy")"
  on_rollout_workers "$(check_script "$copy")"
}

# check_script COPY: the remote script of `check` (COPY: the log to the workdir, or "").
check_script() {
  printf '%s' "$LOG_VARS; \
if [ ! -f \"\$log\" ]; then echo \"== \$(hostname): no log at \$log\"; exit 0; fi; \
if $ALIVE; then state=running; elif [ -f \"\$log.rc\" ]; then \
state=\"exited with status \$(cat \"\$log.rc\")\"; else state='not running'; fi; \
printf '== %s: %s\n%s\n' \"\$(hostname)\" \"\$state\" \"\$(tail -n $LOG_LINES \"\$log\")\"$1"
}

cmd_stop() {
  resolve_run
  local script="$LOG_VARS; if $ALIVE; then kill -TERM \"\$(cat \"\$log.pid\")\" \
&& echo \"\$(hostname): SIGTERM sent\"; else echo \"\$(hostname): not running\"; fi"
  on_all_workers "$script"
  on_rollout_workers "$script"
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
  require TPU_NAME "the TPU VM name, e.g. TPU_NAME=rl-pod"
  check_name TPU_NAME
  require ZONE "the TPU's zone, e.g. ZONE=us-east5-a"
  case "$subcommand" in
    create | setup | run | check | stop) "cmd_$subcommand" ;;
    delete) gcloud_tpu delete "$TPU_NAME" ;;
    *) die "unknown subcommand '$subcommand' (create|setup|run|check|stop|delete)" ;;
  esac
}

main "$@"
