# Helpers shared by the launch scripts (sourced, not run).
# shellcheck shell=bash

die() { echo "${0#"$PWD"/}: error: $*" >&2; exit 2; }

# The arguments as one shell-quoted line: plain words as they are, anything else in single
# quotes, so that the line can be pasted into a shell or passed to `ssh --command`.
quote() {
  local out=() arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+=("$arg")
    else
      out+=("'${arg//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

# Runs a command, or with DRY_RUN=1 prints it as a shell-quoted line.
run() {
  if ((DRY_RUN)); then
    quote "$@"
  else
    "$@"
  fi
}
