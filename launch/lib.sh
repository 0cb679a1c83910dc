# shellcheck shell=bash
# Helpers shared by the launch scripts (sourced, never run). Tested with bash 5.2; no
# mapfile, namerefs or ${x,,}, so that macOS's bash 3.2 has a chance (untested there).
#
# Every command that touches a cluster goes through `run`: with DRY_RUN=1 it is printed,
# shell-quoted so that the output can be pasted back into a shell, and not run.

DRY_RUN=0

# die MESSAGE: one line on stderr naming the script, exit 2.
die() {
  printf '%s: %s\n' "$(basename "$0")" "$1" >&2
  exit 2
}

# require NAME HINT: stop with one line if the variable NAME is unset or empty.
require() {
  [[ -n "${!1:-}" ]] || die "$1 is not set ($2)"
}

# check_name NAME: the variable's value may appear unquoted in paths and remote commands.
check_name() {
  [[ "${!1}" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] \
    || die "$1='${!1}' may only hold letters, digits, '.', '_' and '-'"
}

# shquote ARG...: the arguments as one shell-quoted line (POSIX single quotes where needed).
shquote() {
  local out="" a r
  for a in "$@"; do
    if [[ -n "$a" && "$a" != *[!A-Za-z0-9_./=:,@%+-]* ]]; then
      out+="$a "
    else
      r=${a//\'/\'\\\'\'}
      out+="'$r' "
    fi
  done
  printf '%s' "${out% }"
}

# run CMD ARG...: print the command (stdout in a dry run, stderr otherwise) and run it
# unless DRY_RUN=1.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%s\n' "$(shquote "$@")"
  else
    printf '+ %s\n' "$(shquote "$@")" >&2
    "$@"
  fi
}

# note TEXT: a comment line in the dry-run transcript (stderr in a real run).
note() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '# %s\n' "$1"
  else
    printf '# %s\n' "$1" >&2
  fi
}

# split_words NAME STRING: splits STRING into the array NAME the way a shell splits quoted
# words ('a b', "a b", a\ b), without expanding variables, globs or command substitutions.
split_words() {
  local _name=$1 _text=$2 _word
  eval "$_name=()"
  [[ -n "${_text//[[:space:]]/}" ]] || return 0
  printf '%s\n' "$_text" | xargs printf '' 2>/dev/null \
    || die "$_name: unbalanced quotes in: $_text"
  while IFS= read -r -d '' _word; do
    eval "$_name+=(\"\$_word\")"
  done < <(printf '%s\n' "$_text" | xargs printf '%s\0')
}

# config_run_name CONFIG: the default run name, the config file's name without .py, so
# that rerunning the same command resumes the same run.
config_run_name() {
  local base
  base=$(basename "$1")
  printf '%s' "${base%.py}"
}

# parse_common ARG...: handles --dry-run and --help (calls `usage`); leaves the other
# arguments in the array ARGS.
parse_common() {
  ARGS=()
  while (($#)); do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      --)
        ARGS+=("$@")
        return 0
        ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
}
