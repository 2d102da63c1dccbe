# Sourced by the GPU scripts: sets PY to the project's Python the way the Makefile picks it, so that right after
# `make run` (which creates .venv/) a script works without activating anything:
#   PY=/path/to/python given          -> that interpreter as it is;
#   a virtual environment is active   -> $VIRTUAL_ENV/bin/python;
#   a conda env other than base       -> $CONDA_PREFIX/bin/python;
#   otherwise                         -> $VENV/bin/python (VENV defaults to .venv, as in the Makefile);
#   no such .venv                     -> python3 from PATH (a machine set up by hand), said in one line on stderr.
# No interpreter at all is one line naming it and the fix (exit 2).
if [[ -z "${PY:-}" ]]; then
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PY="$VIRTUAL_ENV/bin/python"
  elif [[ -n "${CONDA_PREFIX:-}" && -n "${CONDA_DEFAULT_ENV:-}" && "${CONDA_DEFAULT_ENV}" != "base" ]]; then
    PY="$CONDA_PREFIX/bin/python"
  elif [[ -x "${VENV:-.venv}/bin/python" ]]; then
    PY="${VENV:-.venv}/bin/python"
  elif command -v python3 >/dev/null 2>&1; then
    echo "$0: no ${VENV:-.venv}/bin/python (make setup creates it); using $(command -v python3) from PATH" >&2
    PY=python3
  else
    PY="${VENV:-.venv}/bin/python"
  fi
fi
if ! command -v "$PY" >/dev/null 2>&1; then
  fix="run \`make setup\` (it creates ${VENV:-.venv}/), activate an environment with the project, or set PY=/path/to/python"
  echo "$0: no Python at $PY; $fix" >&2
  exit 2
fi
