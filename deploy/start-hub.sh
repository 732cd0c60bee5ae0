#!/usr/bin/env bash
# The course image's entry point (deploy/Dockerfile): accounts from the rosters, the shared folders
# with nbgrader's permissions, the course built once, then JupyterHub in course mode.
set -euo pipefail

: "${FASTDL_INSTRUCTORS:?set FASTDL_INSTRUCTORS to the instructors' names (comma-separated)}"
: "${FASTDL_STUDENTS:?set FASTDL_STUDENTS to the students' names (comma-separated)}"
PASSWORDS=${FASTDL_PASSWORDS_FILE:-/run/secrets/passwords}

account() {  # name, then any extra groups
  id -u "$1" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$1"
  if [ -n "${2:-}" ]; then usermod -aG "$2" "$1"; fi
}
for name in ${FASTDL_INSTRUCTORS//,/ }; do account "$name" fastdl-instructors; done
for name in ${FASTDL_STUDENTS//,/ }; do account "$name"; done
if [ -f "$PASSWORDS" ]; then
  chpasswd < "$PASSWORDS"
else
  echo "no $PASSWORDS: set passwords (name:password lines) or nobody can log in" >&2
fi

# nbgrader's exchange: everyone writes, sticky so no one removes what another made.
mkdir -p "$FASTDL_EXCHANGE" "$FASTDL_HUB_STATE" "$FASTDL_COURSE_DIR"
chmod 1777 "$FASTDL_EXCHANGE"
chmod 700 "$FASTDL_HUB_STATE"
chown grader-fastdl-lab:fastdl-instructors "$FASTDL_COURSE_DIR"
chmod 2770 "$FASTDL_COURSE_DIR"

if [ ! -d "$FASTDL_COURSE_DIR/release" ]; then
  echo "building the course in $FASTDL_COURSE_DIR"
  # su resets PATH; nbgrader calls alembic by name, so the environment's bin/ goes first again.
  su grader-fastdl-lab -s /bin/bash -c "cd /opt/fastdl/instructor && env PATH='$PATH' \
    PYTHONPATH=/opt/fastdl/instructor python -m autograder --course '$FASTDL_COURSE_DIR' build"
fi

cd "$FASTDL_HUB_STATE"
exec python -m jupyterhub -f /opt/fastdl/instructor/deploy/jupyterhub_config.py
