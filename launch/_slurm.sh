# Sourced by launch/cluster for --slurm. Not meant to be run.
#
# A Slurm cluster on the emulated nodes: one munged, one slurmctld, one slurmd
# per node, each node's slurmd in the node's network namespace under the node's
# hostname (`slurmd -N NODE`, inside `unshare --uts`), so that what Slurm
# starts on a node (the batch script, srun's tasks, Open MPI's prted) runs
# there, as the rest of launch/cluster's ranks do.
#
# - munged: its socket is a file path ($STATE/slurm/munge.socket; AuthInfo in
#   slurm.conf), and a path reaches every network namespace, so one daemon
#   with a key of its own serves the head and every node;
# - slurmctld: at the head's address, under the hostname PREFIX-head (it must
#   find its own name in SlurmctldHost), in the head's network namespace;
# - slurm.conf: written here, the nodes at their addresses with their share of
#   the machine's cores (at least --ranks-per-node), one partition; process
#   tracking and task binding that need neither systemd nor cgroups
#   (proctrack/linuxproc, task/affinity; slurmd still wants the cgroup file
#   system mounted: SLURM_CGROUP_MOUNT); every state and spool folder under
#   $STATE/slurm, which teardown removes with the rest of the nodes' state.
#   /etc/slurm/slurm.conf points at it while the cluster is up, when that path
#   is free (so `sbatch` typed anywhere finds it); otherwise SLURM_CONF must.
#
# Not here: accounting (slurmdbd), cgroups, GPUs (GRES), several partitions.
# Needs Debian's slurmctld, slurmd, slurm-client and munge (Slurm 22.05 on
# Debian 12), plus libpmix-dev for `srun --mpi=pmix`; `--install` installs
# them with apt-get, nothing does unasked.

SLURM_PKGS="slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins libpmix-dev"
SLURM_ETC_CONF=/etc/slurm/slurm.conf

slurm_dir() { echo "$STATE/slurm"; }

# `ip netns exec` mounts a sysfs of the node's own, without /sys/fs/cgroup, and slurmd 22.05 will
# not start without the cgroup file system the machine has (even with proctrack/linuxproc, which
# makes no cgroup): this mounts it again, in the node's mount namespace only (nothing to undo
# outside). cgroup v2 alone: one cgroup2 mount; v1 or hybrid: a tmpfs and each v1 hierarchy
# /proc/self/cgroup names (slurmd 22.05 then takes cgroup/v1).
SLURM_CGROUP_MOUNT='if [ "$(grep -vc "^0::" /proc/self/cgroup)" = 0 ]; then mount -t cgroup2 none /sys/fs/cgroup;
    else mount -t tmpfs cgroup /sys/fs/cgroup && for c in $(cut -d: -f2 /proc/self/cgroup); do
        [ -n "$c" ] && mkdir -p "/sys/fs/cgroup/${c#name=}" && mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/${c#name=}";
    done; fi'

slurm_missing() {  # prints the first missing command or plugin, nothing when all are there
    local c
    for c in munged slurmctld slurmd sbatch srun sinfo scontrol; do
        command -v "$c" >/dev/null 2>&1 || { echo "'$c'"; return; }
    done
    compgen -G "/usr/lib/x86_64-linux-gnu/slurm-wlm/mpi_pmix*.so" >/dev/null \
        || compgen -G "/usr/lib/*/slurm-wlm/mpi_pmix*.so" >/dev/null || { echo "Slurm's mpi_pmix plugin"; return; }
    compgen -G "/usr/lib/*/libpmix.so" >/dev/null || echo "libpmix.so (libpmix-dev, which srun --mpi=pmix loads)"
}

slurm_install() {  # apt-get, only when asked (--install); one line on failure
    [ -z "$(slurm_missing)" ] && return 0
    command -v apt-get >/dev/null || die "--install needs apt-get (Debian/Ubuntu); install Slurm and munge yourself"
    echo "$ME: installing $SLURM_PKGS (apt-get)" >&2
    local out policy=/usr/sbin/policy-rc.d made=""
    # the packages' scripts would start munge and Slurm's own services: nothing starts but ours
    if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && made=1; fi
    out="$( { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
              $SLURM_PKGS; } 2>&1)"
    local rc=$?
    [ -n "$made" ] && rm -f "$policy"
    [ $rc = 0 ] || die "could not install Slurm: apt-get said: $(echo "$out" | grep -E '^E:' | head -n 1)"
    local miss
    miss="$(slurm_missing)"
    [ -z "$miss" ] || die "installed $SLURM_PKGS, but $miss is still missing"
}

slurm_preflight() {
    [ "$INSTALL" = 1 ] && slurm_install
    local miss
    miss="$(slurm_missing)"
    [ -z "$miss" ] || die "--slurm needs Slurm and munge, and $miss is missing" \
        "(add --install to apt-get $SLURM_PKGS)"
}

slurm_node_cpus() {  # CPUs node $1 declares: its share of the machine's cores, at least --ranks-per-node
    local c
    c="$(tr ',' '\n' < "$STATE/$(node "$1").cpus" | grep -c .)"
    [ "$c" -lt "$PPN" ] && c="$PPN"
    echo "$c"
}

slurm_write_conf() {
    local d i n
    d="$(slurm_dir)"
    {
        echo "# written by ringzero's launch/cluster --slurm: the emulated nodes of cluster '$PREFIX'"
        echo "ClusterName=ringzero-$PREFIX"
        echo "SlurmctldHost=$PREFIX-head($HEAD)"
        echo "SlurmctldPort=$SLURM_CTLD_PORT"
        echo "SlurmdPort=6818"                       # one per node namespace: no clash
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$d/munge.socket"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "StateSaveLocation=$d/ctld"
        echo "SlurmdSpoolDir=$d/spool-%n"
        echo "SlurmctldPidFile=$d/slurmctld.pid"
        echo "SlurmdPidFile=$d/slurmd-%n.pid"
        echo "SlurmctldLogFile=$d/slurmctld.log"
        echo "SlurmdLogFile=$d/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"      # no cgroups, no systemd here
        echo "TaskPlugin=task/affinity"              # binds each task to its --cpus-per-task CPUs
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "MpiDefault=none"                       # srun --mpi=pmix asks for PMIx itself
        echo "ReturnToService=2"
        echo "SlurmdParameters=config_overrides"     # the CPUs below, not what each node's hardware shows
        echo "SlurmdTimeout=${RINGZERO_SLURMD_TIMEOUT:-30}"     # a node cut off is DOWN in about this long
        echo "KillWait=10"                           # SIGTERM, then SIGKILL 10 s later (scancel, time limit)
        echo "InactiveLimit=0"
        echo "MinJobAge=600"                         # a finished job stays in scontrol for 10 min
        for (( i = 1; i <= NODES; i++ )); do
            n="$(node "$i")"
            echo "NodeName=$n NodeAddr=$SUBNET.$i CPUs=$(slurm_node_cpus "$i") State=UNKNOWN"
        done
        echo "PartitionName=ringzero Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } > "$d/slurm.conf"
    # Slurm's PMIx makes its clients' folder at /tmp/spmix_appdir_UID_JOB.STEP on every node, and
    # the nodes share /tmp here: each node's $d/local is a folder of its own (bound in its mount
    # namespace), as a real node's local disk would be
    echo "PMIxCliTmpDirBase=$d/local" > "$d/mpi.conf"
}

slurm_fail() {  # $1: what failed; the last error line of the daemons' logs; remove everything; one line
    local d why
    d="$(slurm_dir)"
    why="$(cat "$d"/*.log "$d"/*.out 2>/dev/null | grep -iE 'error|fatal' | tail -n 1)"
    teardown
    die "--slurm: $1${why:+: $why}"
}

slurm_start() {
    local d i n out
    d="$(slurm_dir)"
    mkdir -p "$d/ctld" "$d/local" && chmod 700 "$d" || slurm_fail "cannot create $d"
    SLURM_CTLD_PORT=$(( 16817 + 2 * NET ))            # the head's namespace is shared by every cluster
    echo "SLURM_CTLD_PORT=$SLURM_CTLD_PORT" >> "$STATE/conf"
    slurm_write_conf
    # munge: a fresh key, readable by root alone
    (umask 077 && head -c 1024 /dev/urandom > "$d/munge.key") || slurm_fail "cannot write the munge key"
    out="$(munged --force --socket="$d/munge.socket" --key-file="$d/munge.key" --log-file="$d/munged.log" \
                  --pid-file="$d/munged.pid" --seed-file="$d/munged.seed" 2>&1)" \
        || slurm_fail "munged would not start: ${out%%$'\n'*}"
    # slurmctld under the name SlurmctldHost gives it
    unshare --uts sh -c "hostname $PREFIX-head && exec slurmctld -f '$d/slurm.conf' -c -i" \
        > "$d/slurmctld.out" 2>&1 || slurm_fail "slurmctld would not start"
    for (( i = 1; i <= NODES; i++ )); do
        n="$(node "$i")"
        mkdir -p "$d/spool-$n"
        mkdir -p "$d/local-$n"
        ip netns exec "$n" unshare --uts sh -c "$SLURM_CGROUP_MOUNT && mount --bind '$d/local-$n' '$d/local' &&
            hostname $n && exec slurmd -f '$d/slurm.conf' -N $n" \
            > "$d/slurmd-$n.out" 2>&1 || slurm_fail "slurmd would not start on $n"
    done
    [ -e "$SLURM_ETC_CONF" ] || { mkdir -p "$(dirname "$SLURM_ETC_CONF")" && ln -s "$d/slurm.conf" "$SLURM_ETC_CONF"; }
    slurm_await_idle
}

slurm_await_idle() {  # every node registered and idle within 30 s
    local t state
    export SLURM_CONF="$(slurm_dir)/slurm.conf"
    for (( t = 0; t < 150; t++ )); do
        state="$(sinfo -h -N -o '%N %T' 2>/dev/null)"
        [ "$(echo "$state" | grep -c ' idle$')" = "$NODES" ] && return 0
        sleep 0.2
    done
    slurm_fail "the nodes did not come up idle within 30 s (sinfo: $(echo $state))"
}

slurm_stop() {  # slurmctld and munged (the slurmds and their jobs die with the nodes' processes)
    local d p f
    d="$(slurm_dir)"
    [ -d "$d" ] || return 0
    for f in slurmctld munged; do
        p="$(cat "$d/$f.pid" 2>/dev/null)"
        [ -n "$p" ] && kill -9 "$p" 2>/dev/null
    done
    [ -L "$SLURM_ETC_CONF" ] && [ "$(readlink "$SLURM_ETC_CONF")" = "$d/slurm.conf" ] && rm -f "$SLURM_ETC_CONF"
    return 0
}

slurm_describe() {
    local d
    d="$(slurm_dir)"
    echo "  Slurm: slurmctld at $HEAD:$SLURM_CTLD_PORT, a slurmd in each node, munged at $d/munge.socket"
    SLURM_CONF="$d/slurm.conf" sinfo -N -o '%N %T %c %P' | sed 's/^/  /'
    if [ "$(readlink "$SLURM_ETC_CONF" 2>/dev/null)" = "$d/slurm.conf" ]; then
        echo "  slurm.conf: $d/slurm.conf (also $SLURM_ETC_CONF while the cluster is up)"
    else
        echo "  slurm.conf: $d/slurm.conf ($SLURM_ETC_CONF is another: export SLURM_CONF=$d/slurm.conf)"
    fi
}

run_slurm_job() {  # the run form with --slurm: build, start Slurm, run CMD on the head, remove it all
    local rc
    in_use_msg="$(in_use)"
    [ -z "$in_use_msg" ] || die "$in_use_msg"
    trap teardown EXIT
    trap 'on_signal SIGINT 130' INT
    trap 'on_signal SIGTERM 143' TERM
    build
    slurm_start
    describe | head -n 1
    echo "$ME: Slurm is up (SLURM_CONF=$SLURM_CONF); running: ${CMD[*]}"
    "${CMD[@]}" &
    JOB=$!
    wait "$JOB"
    rc=$?
    JOB=""
    return $rc
}
