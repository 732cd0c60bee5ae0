#!/usr/bin/env bash
# The grading image's entry point in production (deploy/Dockerfile, started by docker-compose.yml
# or a Kubernetes Deployment): `start-grader.sh formgrader`, `start-grader.sh scheduler` or
# `start-grader.sh worker`. The grading image holds the solutions, the autograder and bubblewrap;
# no student's server runs in it, and only the formgrader is reachable from the hub's network.
set -euo pipefail

GRADER=grader-fastdl-lab
ROSTER=${FASTDL_ROSTER:-/srv/fastdl/roster/roster.json}
ROSTER_CSV=$(dirname "$ROSTER")/roster.csv
ROLE=${1:?say formgrader, scheduler or worker}
export PYTHONPATH=/opt/fastdl/instructor

as_grader() {  # su resets PATH; nbgrader calls alembic by name
  su "$GRADER" -s /bin/bash -c "cd \"$FASTDL_COURSE_DIR\" && env PATH='$PATH' PYTHONPATH='$PYTHONPATH' $*"
}

case "$ROLE" in
  formgrader)
    # nbgrader's exchange on its shared volume: everyone writes, sticky so no one removes what
    # another made; nbgrader makes inbound/ writable but not listable when it releases.
    mkdir -p "$FASTDL_EXCHANGE" "$FASTDL_COURSE_DIR" "$(dirname "$ROSTER")"
    # Instructors import the roster from the formgrader's terminal, as the grader's account.
    chown "$GRADER" "$(dirname "$ROSTER")"
    chmod 1777 "$FASTDL_EXCHANGE"
    chown "$GRADER:fastdl-instructors" "$FASTDL_COURSE_DIR"
    chmod 2770 "$FASTDL_COURSE_DIR"
    if [ ! -d "$FASTDL_COURSE_DIR/release" ]; then
      as_grader "python -m autograder --course '$FASTDL_COURSE_DIR' build"
    fi
    # The roster, at every start: a new roster.csv in the roster volume takes effect with a restart
    # of this container and then of the hub. Rows it refuses are listed; the others are imported.
    if [ -f "$ROSTER_CSV" ]; then
      as_grader "python -m autograder --course '$FASTDL_COURSE_DIR' roster import '$ROSTER_CSV' --hub '$ROSTER'" \
        || echo "roster: the rows above were not imported; correct them in $ROSTER_CSV and restart" >&2
    fi
    # nbgrader's collect, run here, compares each submission's owner with the name it is filed
    # under. Students' servers run as the uids the roster gave them; naming those uids here makes an
    # honest submission match, and leaves the warning ("cheating attempt?") for a folder filed under
    # someone else's name. A name already known is not added twice.
    if [ -f "$ROSTER" ]; then
      python -m autograder roster passwd "$ROSTER" | while IFS= read -r line; do
        getent passwd "${line%%:*}" >/dev/null || echo "$line" >> /etc/passwd
      done
    else
      echo "no roster at $ROSTER: copy roster.csv to $ROSTER_CSV and restart this container" >&2
    fi
    # An external service of the hub (deploy/production/jupyterhub_config.py): the hub sets these
    # variables for the services it starts itself; this one starts here.
    export JUPYTERHUB_SERVICE_NAME=fastdl-lab JUPYTERHUB_CLIENT_ID=service-fastdl-lab \
      JUPYTERHUB_SERVICE_PREFIX=/services/fastdl-lab/ JUPYTERHUB_SERVICE_URL=http://0.0.0.0:9999 \
      JUPYTERHUB_OAUTH_CALLBACK_URL=/services/fastdl-lab/oauth_callback JUPYTERHUB_DEFAULT_URL=/formgrader \
      JUPYTERHUB_API_TOKEN="${FASTDL_FORMGRADER_TOKEN:?the token the hub was given for the fastdl-lab service}" \
      JUPYTERHUB_API_URL="${JUPYTERHUB_API_URL:-http://hub:8081/hub/api}" \
      JUPYTER_CONFIG_PATH=/opt/fastdl/jupyter/grader:/opt/fastdl/jupyter/course
    exec su "$GRADER" -s /bin/bash -c "cd '$FASTDL_COURSE_DIR' && exec env PATH='$PATH' jupyterhub-singleuser \
      --ServerApp.root_dir='$FASTDL_COURSE_DIR'"
    ;;
  scheduler)
    # One retry for a lost job, one job at a time per worker (README, "Grading a class").
    export DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=1 DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION=1.0
    exec su "$GRADER" -s /bin/bash -c "exec env PATH='$PATH' dask scheduler --port 8786"
    ;;
  worker)
    # One worker per GPU, each declaring it, so that a speed item never shares its GPU; workers
    # start processes of their own (lab 06's DataLoader), hence not daemonic.
    exec su "$GRADER" -s /bin/bash -c "cd '$FASTDL_COURSE_DIR' && exec env PATH='$PATH' PYTHONPATH='$PYTHONPATH' \
      DASK_DISTRIBUTED__WORKER__DAEMON=False dask worker '${FASTDL_SCHEDULER:-tcp://scheduler:8786}' \
      --nthreads 1 --memory-limit 0 --resources GPU=1"
    ;;
  *)
    echo "unknown role $ROLE: say formgrader, scheduler or worker" >&2; exit 2 ;;
esac
