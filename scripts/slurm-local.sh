#!/usr/bin/env bash
# slurm-local.sh - run a REAL single-machine Slurm cluster (with slurmdbd
# accounting) for integration tests.
#
# Usage: scripts/slurm-local.sh {up|down|status|env|restart-controller [SECONDS]}
#   up      install missing Debian packages, start munged, mariadb, slurmdbd,
#           slurmctld and 4 slurmd (node[1-4]); wait until all nodes are idle;
#           print `export SLURM_CONF=...`. Idempotent: starts only what is down.
#   down    stop only the processes `up` started (by their pid files).
#   status  show each daemon (by pid file) and `sinfo`; exit 0 iff all are up.
#   env     print `export SLURM_CONF=<state>/slurm.conf`.
#   restart-controller [SECONDS]  stop slurmctld alone, wait (default 15 s), start it again (an outage drill).
#
# All state (configs, munge key/socket, mariadb datadir, spool, logs, pids)
# lives in ${LAUNCHER_SLURM_DIR:-<repo>/.slurm-local}. Nothing system-wide is
# configured or started; the system munge/mariadb/slurm services are untouched.
# Ports: slurmctld 14817, slurmdbd 14819, mariadb 14306 (127.0.0.1 only),
# slurmd node1..4 on 14001..14004 (all below launcher.runtime.env.PORT_BASE, so that no job's derived
# rendezvous port is one of them), each plus ${LAUNCHER_SLURM_PORT_OFFSET:-0}: a second
# cluster (another checkout, its own LAUNCHER_SLURM_DIR) runs beside the first with an offset.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${LAUNCHER_SLURM_DIR:-$REPO/.slurm-local}"
mkdir -p "$STATE"
STATE="$(cd "$STATE" && pwd)"   # absolute: daemons chdir and configs need it

CLUSTER=launcher
NODES=(node1 node2 node3 node4)
OFFSET=${LAUNCHER_SLURM_PORT_OFFSET:-0}
CTLD_PORT=$((14817 + OFFSET))
DBD_PORT=$((14819 + OFFSET))
DB_PORT=$((14306 + OFFSET))
NODE_PORT_BASE=$((14001 + OFFSET))
NODE_CPUS=4
NODE_MEM=4000
GPUS_PER_NODE=2
DB_USER=slurm
DB_PASS=slurmlocal
UP_TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
# Slurm's own default (10,000 jobs held, ended ones until MinJobAge); the scale benchmarks raise it to hold
# a 10,000-point sweep beside another one. Read when the configuration is written (a cluster started anew).
MAX_JOBS=${LAUNCHER_SLURM_MAX_JOBS:-10000}

CONF="$STATE/slurm.conf"
DBD_CONF="$STATE/slurmdbd.conf"
RUN="$STATE/run"
LOG="$STATE/log"
MUNGE_DIR="$STATE/munge"
MUNGE_SOCK="$MUNGE_DIR/munge.socket"
DB_DIR="$STATE/mysql"
DB_SOCK="$RUN/mysqld.sock"

# Our own client calls (sinfo, sacctmgr, scontrol) must use our cluster.
export SLURM_CONF="$CONF"

PACKAGES=(munge mariadb-server mariadb-client slurmdbd slurmctld slurmd slurm-client)

log() { echo "[slurm-local] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------- install --
install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "need root to install: ${missing[*]}"
    log "installing: ${missing[*]}"
    # Keep the packages' maintainer scripts from starting the *system*
    # munge/mariadb/slurm services: policy-rc.d exit 101 = "do not start".
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        created_policy=1
    fi
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } || rc=$?
    [ "$created_policy" -eq 1 ] && rm -f "$policy"
    [ "$rc" -eq 0 ] || die "apt-get failed (rc=$rc)"
}

# ------------------------------------------------------------ pid helpers --
# A pid file counts only if its process is alive AND its command line mentions
# our state dir, so a recycled pid (or a system daemon) is never mistaken for
# ours and never killed.
pid_of() {  # name -> prints pid if running, returns 1 otherwise
    local f="$RUN/$1.pid" pid
    [ -s "$f" ] || return 1
    pid="$(tr -dc '0-9' <"$f")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    # slurmdbd takes no config flag: it is recognised by SLURM_CONF in its env.
    tr '\0' '\n' <"/proc/$pid/cmdline" | grep -qF -- "$STATE" \
        || tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF -- "SLURM_CONF=$CONF" \
        || return 1
    echo "$pid"
}
running() { pid_of "$1" >/dev/null; }

DAEMONS=(munged mariadb slurmdbd slurmctld)
for _n in "${NODES[@]}"; do DAEMONS+=("slurmd-$_n"); done

wait_for() {  # timeout_s description command... : poll until command succeeds
    local t=$1 what=$2; shift 2
    local end=$((SECONDS + t))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || { log "timed out waiting for $what"; return 1; }
        sleep 0.5
    done
}

fail_with_logs() {
    log "$1"
    local f
    for f in "$LOG"/*.log; do
        [ -f "$f" ] || continue
        echo "===== tail $f =====" >&2
        tail -n 25 "$f" >&2
    done
    exit 1
}

# ---------------------------------------------------------------- configs --
write_configs() {
    mkdir -p "$RUN" "$LOG" "$STATE/spool/ctld" "$STATE/dev"
    local n
    for n in "${NODES[@]}"; do mkdir -p "$STATE/spool/slurmd-$n"; done

    # Fake GPUs: character devices (same major/minor as /dev/null) so gres/gpu
    # has File= entries; slurm then sets CUDA_VISIBLE_DEVICES for --gpus jobs.
    # Where mknod is not allowed (unprivileged container) run without GPUs.
    local i gres_node="" gres_types="" gres_file=""
    for ((i = 0; i < GPUS_PER_NODE; i++)); do
        [ -c "$STATE/dev/nvidia$i" ] || mknod "$STATE/dev/nvidia$i" c 1 3 2>/dev/null || {
            log "WARNING: mknod not permitted; fake GPUs disabled"
            GPUS_PER_NODE=0
        }
    done
    if [ "$GPUS_PER_NODE" -gt 0 ]; then
        gres_types="GresTypes=gpu"
        gres_node="Gres=gpu:$GPUS_PER_NODE"
        gres_file="$STATE/dev/nvidia[0-$((GPUS_PER_NODE - 1))]"
    fi

    local last=$((NODE_PORT_BASE + ${#NODES[@]} - 1))
    cat >"$CONF" <<EOF
# Generated by scripts/slurm-local.sh - do not edit (rewritten on 'up').
ClusterName=$CLUSTER
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also holds a requeued job back before it may start again (default 120 s): the
# fault-tolerance tests requeue jobs and wait for them
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10

StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
# No mail on this box; an existing binary silences "MailProg is invalid".
MailProg=/bin/true
SlurmdDebug=info

# No cgroups in containers/CI: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# Nodes claim 4 CPUs on a 2-core host: trust slurm.conf, not the hardware.
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
# A requeued job becomes eligible ~10 s after its requeue, which is no scheduling event: it waits for the
# next scheduling pass (default every 60 s, backfill 30 s). A 4-node test cluster can afford a pass
# every 2 s, so requeue drills wait on the product, not on the pass.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
KillWait=2
InactiveLimit=0
# Finished jobs leave slurmctld quickly; sacct (slurmdbd) keeps the records.
MinJobAge=30
MaxJobCount=$MAX_JOBS
SlurmdTimeout=60
$gres_types

AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# For slurmdbd connections the "password" is the munge socket to use.
AccountingStoragePass=$MUNGE_SOCK
# As most sites do: a job needs an association, and its association's and QOS's limits (MaxSubmitJobs,
# ...) hold. Adding the cluster gives root one; the user who runs the tests gets one in the same account.
AccountingStorageEnforce=associations,limits,qos
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

NodeName=node[1-${#NODES[@]}] NodeAddr=127.0.0.1 Port=[$NODE_PORT_BASE-$last] CPUs=$NODE_CPUS RealMemory=$NODE_MEM $gres_node State=UNKNOWN
PartitionName=debug Nodes=node[1-${#NODES[@]}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

    if [ -n "$gres_file" ]; then
        cat >"$STATE/gres.conf" <<EOF
AutoDetect=off
NodeName=node[1-${#NODES[@]}] Name=gpu File=$gres_file
EOF
    else
        rm -f "$STATE/gres.conf"
    fi

    # slurmdbd refuses a config readable by others.
    (umask 077; cat >"$DBD_CONF" <<EOF
# Generated by scripts/slurm-local.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    )
    chmod 600 "$DBD_CONF"
}

# ---------------------------------------------------------------- daemons --
start_munged() {
    running munged && return 0
    mkdir -p "$MUNGE_DIR"
    # munged checks ownership/permissions: key 0600, dirs not group/other
    # writable; the socket dir must be world-executable so clients can reach it.
    chmod 755 "$MUNGE_DIR"
    if [ ! -s "$MUNGE_DIR/munge.key" ]; then
        (umask 077; dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none)
    fi
    chmod 600 "$MUNGE_DIR/munge.key"
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCK" \
        --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" --num-threads=2 --force \
        </dev/null >>"$LOG/munged.log" 2>&1 \
        || fail_with_logs "munged failed to start"
    wait_for 10 munged bash -c "munge -S '$MUNGE_SOCK' -n | unmunge -S '$MUNGE_SOCK'" \
        || fail_with_logs "munge socket not working"
}

# shellcheck disable=SC2120  # also called with args via wait_for
db() { mariadb --no-defaults --socket="$DB_SOCK" -u root "$@"; }

start_mariadb() {
    running mariadb && return 0
    if [ ! -d "$DB_DIR/mysql" ]; then
        log "initialising mariadb datadir"
        mkdir -p "$DB_DIR"
        mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR" \
            --auth-root-authentication-method=socket --skip-test-db \
            >"$LOG/mariadb-install.log" 2>&1 \
            || fail_with_logs "mariadb-install-db failed"
    fi
    rm -f "$DB_SOCK"
    # mariadbd does not daemonize: detach it ourselves; it writes its own pid.
    setsid mariadbd --no-defaults --user=root --datadir="$DB_DIR" \
        --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 \
        --skip-name-resolve --pid-file="$RUN/mariadb.pid" \
        --log-error="$LOG/mariadb.log" --innodb-buffer-pool-size=256M \
        --innodb-lock-wait-timeout=900 \
        </dev/null >>"$LOG/mariadb.log" 2>&1 &
    wait_for 30 mariadb db -e 'SELECT 1' || fail_with_logs "mariadb did not come up"
    wait_for 5 "mariadb pid file" running mariadb || fail_with_logs "mariadb pid file missing"
    # slurmdbd connects over TCP (127.0.0.1) with a password.
    db <<EOF
CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO '$DB_USER'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
    running slurmdbd && return 0
    # slurmdbd reads its config from the directory of SLURM_CONF.
    slurmdbd </dev/null >>"$LOG/slurmdbd.log" 2>&1 || fail_with_logs "slurmdbd failed to start"
    # First start creates the tables (a few seconds).
    wait_for 45 slurmdbd sacctmgr -n list cluster || fail_with_logs "slurmdbd not answering"
    wait_for 5 "slurmdbd pid file" running slurmdbd || fail_with_logs "slurmdbd pid file missing"
    # The cluster must exist in the DB for jobs to be accounted; adding it
    # also creates the 'root' account and root user association.
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null || fail_with_logs "sacctmgr add cluster failed"
    fi
    local user="${SUDO_USER:-$(id -un)}"
    if [ "$user" != root ] && ! sacctmgr -n -P list assoc user="$user" format=user | grep -qx "$user"; then
        sacctmgr -i add user "$user" account=root >/dev/null || fail_with_logs "sacctmgr add user $user failed"
    fi
}

start_slurmctld() {
    running slurmctld && return 0
    slurmctld -f "$CONF" </dev/null >>"$LOG/slurmctld.log" 2>&1 || fail_with_logs "slurmctld failed to start"
    wait_for 30 slurmctld scontrol ping || fail_with_logs "slurmctld not answering"
    wait_for 5 "slurmctld pid file" running slurmctld || fail_with_logs "slurmctld pid file missing"
}

start_slurmd() {  # node
    running "slurmd-$1" && return 0
    slurmd -f "$CONF" -N "$1" </dev/null >>"$LOG/slurmd-$1.log" 2>&1 || fail_with_logs "slurmd $1 failed to start"
}

all_idle() {
    local n
    n="$( (sinfo -h -N -p debug -o '%N %t' 2>/dev/null || true) | awk '$2 ~ /^(idle|mix|alloc)$/' | sort -u | wc -l)"
    [ "$n" -eq "${#NODES[@]}" ]
}

all_running() {
    local d
    for d in "${DAEMONS[@]}"; do running "$d" || return 1; done
}

any_running() {
    local d
    for d in "${DAEMONS[@]}"; do running "$d" && return 0; done
    return 1
}

# --------------------------------------------------------------- commands --
cmd_env() { echo "export SLURM_CONF=$CONF"; }

cmd_up() {
    if all_running && all_idle; then
        log "already up ($STATE)"
        cmd_env
        return 0
    fi
    install_packages
    # Rewrite configs only when nothing runs, so live daemons and files agree.
    if ! any_running || [ ! -f "$CONF" ]; then write_configs; fi
    start_munged
    start_mariadb
    start_slurmdbd
    start_slurmctld
    local n
    for n in "${NODES[@]}"; do start_slurmd "$n"; done
    # Nodes that were DOWN (e.g. after an unclean stop) come back via
    # ReturnToService=2; force-resume any left in another state.
    wait_for 10 "slurmd pid files" all_running || fail_with_logs "a daemon did not start"
    if ! wait_for "$UP_TIMEOUT" "nodes idle" all_idle; then
        scontrol update nodename="node[1-${#NODES[@]}]" state=resume >/dev/null 2>&1 || true
        wait_for 10 "nodes idle" all_idle || { sinfo -N >&2 || true; fail_with_logs "nodes not idle after ${UP_TIMEOUT}s"; }
    fi
    log "cluster up: $(sinfo -h -o '%P %D %t %N' | tr '\n' ' ')"
    cmd_env
}

# Exited daemons are reparented to PID 1, which may reap them late: a zombie
# counts as gone.
alive() {
    local st
    st="$(sed -n 's/^.*) \([A-Za-z]\).*/\1/p' "/proc/$1/stat" 2>/dev/null)" || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

stop_one() {  # name: SIGTERM via its pid file, wait, SIGKILL as last resort
    local name=$1 pid i
    pid="$(pid_of "$name")" || { rm -f "$RUN/$name.pid"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then
        log "$name ($pid) ignored SIGTERM, killing"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$RUN/$name.pid"
    log "stopped $name ($pid)"
}

cmd_down() {
    local n
    # Reverse dependency order: nodes, controller, dbd, database, munge.
    for n in "${NODES[@]}"; do stop_one "slurmd-$n"; done
    stop_one slurmctld
    stop_one slurmdbd
    stop_one mariadb
    stop_one munged
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock" "$DB_SOCK"
}

cmd_status() {
    local d pid rc=0
    for d in "${DAEMONS[@]}"; do
        if pid="$(pid_of "$d")"; then
            printf '%-14s running (pid %s)\n' "$d" "$pid"
        else
            printf '%-14s stopped\n' "$d"
            rc=1
        fi
    done
    if running slurmctld; then
        timeout 10 sinfo -N -l || rc=1
    else
        echo "sinfo: slurmctld not running"
    fi
    return $rc
}

# the controller alone stopped for SECONDS, then started again (a controller outage drill: running jobs
# go on, the commands that ask it wait or say so)
cmd_restart_controller() {
    running slurmctld || fail_with_logs "slurmctld is not running (up first)"
    stop_one slurmctld
    sleep "${1:-15}"
    start_slurmctld
    log "slurmctld started again"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    restart-controller) cmd_restart_controller "${2:-15}" ;;
    *) echo "usage: $0 {up|down|status|env|restart-controller [SECONDS]}" >&2; exit 2 ;;
esac
