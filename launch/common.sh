# Helpers shared by the launch scripts (sourced, not run).
# shellcheck shell=bash

die() { echo "${0#"$PWD"/}: error: $*" >&2; exit 2; }

# The Python 3.12 to make mtrain's environment with: python3.12 on PATH (the README's
# command), else pyenv's newest 3.12. Prints its path, or fails with one line.
python312() {
  local version
  if python3.12 -c '' 2> /dev/null; then
    command -v python3.12
  elif command -v pyenv > /dev/null &&
       version="$(pyenv versions --bare 2> /dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1)" &&
       [[ -n "$version" ]]; then
    echo "$(pyenv root)/versions/$version/bin/python3.12"
  else
    die "no Python 3.12 here (mtrain needs it): install python3.12 (e.g. apt install python3.12-venv, or pyenv install 3.12)"
  fi
}

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
