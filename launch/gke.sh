#!/usr/bin/env bash
# Train on a multi-host TPU slice of a GKE cluster: renders launch/gke_jobset.yaml (one pod
# per TPU host, each running the same training command with JAXRL_DISTRIBUTED=1) and
# applies it with kubectl.
#
#   IMAGE=us-docker.pkg.dev/my-project/jaxrl/jaxrl-llm:latest BUCKET=my-bucket \
#     CONFIG=configs/math_grpo_llama3_8b_tpu.py launch/gke.sh apply
#
# Subcommands:
#   render   print the rendered manifest (no kubectl)
#   apply    render and `kubectl apply` the JobSet
#   check    the JobSet's status, its pods, and the last lines of every pod's log
#   delete   delete the JobSet (and its pods)
# Options: --dry-run prints every command (with the manifest it would apply) and runs none;
# --help. Arguments after `--` are passed to the trainer verbatim, after EXTRA_ARGS.
#
# Rollout workers: WORKERS=N adds a second replicated job of N worker pods (one
# single-host slice of WORKER_TPU_TOPOLOGY each, launch/gke_jobset_workers.yaml) started
# before the trainer, which then runs on TPU_TOPOLOGY's hosts (one or several), in
# split mode, with the workers' JobSet DNS names as rollout.worker_addresses. The shared
# secret is the key `token` of the Kubernetes Secret WORKER_TOKEN_SECRET, made once:
#   kubectl create secret generic jaxrl-worker-token --from-literal=token=$(openssl rand -hex 16)
#
# Needs: kubectl pointed at the cluster (gcloud container clusters get-credentials ...),
# the JobSet controller installed, a TPU node pool with TPU_ACCELERATOR / TPU_TOPOLOGY,
# and an image with the repository pip-installed (".[tpu]") whose working directory is
# the repository root (CONFIG is a path relative to it).
set -euo pipefail

# Inputs (environment overrides). Hyperparameters live in configs/; override them with
# EXTRA_ARGS="--config.key=value ..." (quote words with spaces: "--config.x='a b'").
IMAGE=${IMAGE:-}                             # required: the trainer's container image
CONFIG=${CONFIG:-}                           # required: configs/<experiment>.py
BUCKET=${BUCKET:-}                           # required unless WORKDIR is set
RUN_NAME=${RUN_NAME:-}                       # empty: the config's file name (reruns resume)
WORKDIR=${WORKDIR:-}                         # empty: gs://$BUCKET/runs/$RUN_NAME
EXTRA_ARGS=${EXTRA_ARGS:-}                   # --config.key=value overrides
TPU_ACCELERATOR=${TPU_ACCELERATOR:-tpu-v5p-slice}  # node label gke-tpu-accelerator
TPU_TOPOLOGY=${TPU_TOPOLOGY:-2x4x4}          # node label gke-tpu-topology (v5p-64)
CHIPS_PER_HOST=${CHIPS_PER_HOST:-4}          # google.com/tpu per pod
NAMESPACE=${NAMESPACE:-default}
SERVICE_ACCOUNT=${SERVICE_ACCOUNT:-default}  # a Kubernetes SA allowed to write to BUCKET
MAX_RESTARTS=${MAX_RESTARTS:-3}              # whole-set restarts; each resumes
PYTHON=${PYTHON:-python}                     # the image's interpreter
WORKERS=${WORKERS:-0}                        # rollout worker pods (0: the rollout runs in the trainer)
WORKER_TPU_ACCELERATOR=${WORKER_TPU_ACCELERATOR:-}  # empty: TPU_ACCELERATOR
WORKER_TPU_TOPOLOGY=${WORKER_TPU_TOPOLOGY:-2x2x1}   # one host of CHIPS_PER_HOST chips (v5p-8)
WORKER_PORT=${WORKER_PORT:-7070}
WORKER_RESTARTS=${WORKER_RESTARTS:-10}       # a worker pod started again this often
WORKER_TOKEN_SECRET=${WORKER_TOKEN_SECRET:-jaxrl-worker-token}

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=launch/lib.sh
source "$REPO/launch/lib.sh"

TEMPLATE="$REPO/launch/gke_jobset.yaml"
WORKER_TEMPLATE="$REPO/launch/gke_jobset_workers.yaml"
LOG_LINES=20

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  echo "Usage: launch/gke.sh [--dry-run] render|apply|check|delete [-- ARG...]"
}

# yaml_string S: S as a double-quoted YAML (and JSON) scalar.
yaml_string() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  printf '"%s"' "$s"
}

resolve() {
  if [[ -z "$RUN_NAME" ]]; then
    [[ -n "$CONFIG" ]] || die "CONFIG is not set (the experiment, e.g. CONFIG=configs/math_grpo_llama3_8b_tpu.py)"
    RUN_NAME=$(config_run_name "$CONFIG")
  fi
  check_name RUN_NAME
  # Kubernetes names: lowercase letters, digits and '-'.
  JOBSET_NAME=$(printf '%s' "$RUN_NAME" | tr 'A-Z_.' 'a-z--')
  [[ "$JOBSET_NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] \
    || die "RUN_NAME='$RUN_NAME' gives the JobSet name '$JOBSET_NAME', not a valid one"
  [[ "$WORKERS" =~ ^[0-9]+$ ]] || die "WORKERS='$WORKERS' is not a number"
  local chips
  chips=$(topology_chips TPU_TOPOLOGY)
  if ((WORKERS > 0)); then
    ((chips % CHIPS_PER_HOST == 0)) \
      || die "TPU_TOPOLOGY=$TPU_TOPOLOGY ($chips chips) is not a slice of whole hosts of CHIPS_PER_HOST=$CHIPS_PER_HOST"
    NUM_HOSTS=$((chips / CHIPS_PER_HOST))
    chips=$(topology_chips WORKER_TPU_TOPOLOGY)
    ((chips == CHIPS_PER_HOST)) \
      || die "WORKER_TPU_TOPOLOGY=$WORKER_TPU_TOPOLOGY ($chips chips): a worker is one host of CHIPS_PER_HOST=$CHIPS_PER_HOST chips"
    [[ "$WORKER_PORT" =~ ^[1-9][0-9]*$ ]] || die "WORKER_PORT='$WORKER_PORT' is not a port number"
  else
    ((chips % CHIPS_PER_HOST == 0 && chips > CHIPS_PER_HOST)) \
      || die "TPU_TOPOLOGY=$TPU_TOPOLOGY ($chips chips) is not a multi-host slice of CHIPS_PER_HOST=$CHIPS_PER_HOST"
    NUM_HOSTS=$((chips / CHIPS_PER_HOST))
  fi
  WORKER_TPU_ACCELERATOR=${WORKER_TPU_ACCELERATOR:-$TPU_ACCELERATOR}
}

# topology_chips NAME: the chips of the topology in variable NAME (2x4x4 -> 32).
topology_chips() {
  local chips=1 dim
  [[ "${!1}" =~ ^[0-9]+(x[0-9]+)+$ ]] || die "$1='${!1}' is not of the form 2x4x4"
  for dim in ${!1//x/ }; do chips=$((chips * dim)); done
  printf '%s' "$chips"
}

# yaml_list ARG...: the arguments as a YAML (JSON) flow list of strings.
yaml_list() {
  local out="" arg
  for arg in "$@"; do out+="${out:+, }$(yaml_string "$arg")"; done
  printf '[%s]' "$out"
}

render() {
  require CONFIG "the experiment, e.g. CONFIG=configs/math_grpo_llama3_8b_tpu.py"
  require IMAGE "the trainer's container image, e.g. IMAGE=us-docker.pkg.dev/PROJECT/REPO/jaxrl-llm:TAG"
  if [[ -z "$WORKDIR" ]]; then
    require BUCKET "the GCS bucket for the run's workdir, e.g. BUCKET=my-bucket"
    WORKDIR="gs://${BUCKET#gs://}/runs/$RUN_NAME"
  fi
  local extra workers=() addresses="" i text name value
  split_words extra "$EXTRA_ARGS"
  extra+=(${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
  WORKER_JOBS=""
  if ((WORKERS > 0)); then
    # Each worker pod's name on the JobSet's headless service (its subdomain).
    for ((i = 0; i < WORKERS; i++)); do
      addresses+="${addresses:+,}$JOBSET_NAME-workers-$i-0.$JOBSET_NAME:$WORKER_PORT"
    done
    workers=(--config.rollout.mode=split "--config.rollout.workers=$WORKERS"
      "--config.rollout.worker_addresses=$addresses")
    # shellcheck disable=SC2034  # read below through ${!name}
    WORKER_COMMAND=$(yaml_list "$PYTHON" -m jaxrl_llm.workers.serve "--config=$CONFIG" \
      --host=0.0.0.0 "--port=$WORKER_PORT" ${extra[@]+"${extra[@]}"})
    WORKER_JOBS=$(<"$WORKER_TEMPLATE")
  fi
  # shellcheck disable=SC2034  # read below through ${!name}
  TRAIN_COMMAND=$(yaml_list "$PYTHON" -m jaxrl_llm.train "--config=$CONFIG" "--workdir=$WORKDIR" \
    ${extra[@]+"${extra[@]}"} ${workers[@]+"${workers[@]}"})
  text=$(<"$TEMPLATE")
  text=${text//"\${WORKER_JOBS}"/"$WORKER_JOBS"}
  for name in JOBSET_NAME NAMESPACE MAX_RESTARTS NUM_HOSTS SERVICE_ACCOUNT TPU_ACCELERATOR \
    TPU_TOPOLOGY IMAGE TRAIN_COMMAND CHIPS_PER_HOST WORKERS WORKER_TPU_ACCELERATOR \
    WORKER_TPU_TOPOLOGY WORKER_COMMAND WORKER_PORT WORKER_RESTARTS WORKER_TOKEN_SECRET; do
    value=${!name:-}
    text=${text//"\${$name}"/"$value"}
  done
  # shellcheck disable=SC2016  # a literal ${ left in the template
  [[ "$text" != *'${'* ]] || die "$TEMPLATE has a \${...} that gke.sh does not fill in"
  printf '%s\n' "$text"
}

kubectl_apply() {
  local manifest
  manifest=$(render)
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%s <<'\''EOF'\''\n%s\nEOF\n' "$(shquote kubectl apply -f -)" "$manifest"
  else
    printf '+ kubectl apply -f - (the manifest of launch/gke.sh render)\n' >&2
    kubectl apply -f - <<<"$manifest"
  fi
}

main() {
  parse_common "$@"
  set -- ${ARGS[@]+"${ARGS[@]}"}
  (($#)) || {
    usage >&2
    exit 2
  }
  local subcommand=$1 selector
  shift
  TRAIN_ARGS=()
  if (($#)); then
    [[ "$1" == -- ]] || die "unexpected argument '$1' (trainer arguments go after --)"
    shift
    TRAIN_ARGS=("$@")
  fi
  resolve
  selector="jobset.sigs.k8s.io/jobset-name=$JOBSET_NAME"
  case "$subcommand" in
    render) render ;;
    apply) kubectl_apply ;;
    check)
      run kubectl get jobset "$JOBSET_NAME" "--namespace=$NAMESPACE"
      run kubectl get pods "--namespace=$NAMESPACE" "--selector=$selector" -o wide
      run kubectl logs "--namespace=$NAMESPACE" "--selector=$selector" --prefix \
        "--tail=$LOG_LINES" "--max-log-requests=$NUM_HOSTS"
      ;;
    delete) run kubectl delete jobset "$JOBSET_NAME" "--namespace=$NAMESPACE" ;;
    *) die "unknown subcommand '$subcommand' (render|apply|check|delete)" ;;
  esac
}

main "$@"
