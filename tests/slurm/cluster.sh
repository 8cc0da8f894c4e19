#!/usr/bin/env bash
# A throw-away SLURM cluster of two nodes on this one host for the integration tests
# (Debian's slurmctld, slurmd and munge; no slurmdbd, no systemd, no cgroups): every
# daemon is started by hand and stopped by the pid recorded here.
#
#   cluster.sh install   apt-get install the packages if missing (root, apt-get)
#   cluster.sh up        write the configs, start munged, slurmctld and one slurmd per
#                        node (`slurmd -N <node>`: each its own port, spool, log, pid)
#   cluster.sh down      stop only the daemons `up` recorded
#
# The nodes, pycls-n1 and pycls-n2, are this host under two names (added to
# /etc/hosts on 127.0.0.1 while the cluster is up: a job's ranks find their master
# by the first node's name, as on a cluster). Each node offers all of this host's
# cores and memory, so a job of one node fits as on the single-node cluster and a
# job of two nodes gets one task on each.
#
# STATE (default /tmp/pycls_fast_slurm) holds the pid list and the logs.
set -uo pipefail
STATE=${STATE:-/tmp/pycls_fast_slurm}
PIDS=$STATE/pids
HOST=$(hostname -s)
PKGS=(slurmctld slurmd slurm-client munge)
NODES=(pycls-n1 pycls-n2)
PIDFILES="/run/munge/munged.pid /run/slurmctld.pid /run/slurmd-pycls-n1.pid /run/slurmd-pycls-n2.pid"
HOSTS_MARK="# pycls_fast test cluster"
mkdir -p "$STATE"

wait_for() {  # wait_for SECONDS CMD...
  local end=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -ge $end ] && return 1; sleep 0.25; done
}

install() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || {
    echo "cluster.sh: ${missing[*]} missing and no root apt-get to install them"; return 1; }
  # Keep the packages' postinst from starting daemons (no init system here).
  local policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; policy=1
  fi
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    > "$STATE/apt.log" 2>&1
  local rc=$?
  [ $policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  return $rc
}

write_configs() {
  local mem; mem=$(free -m | awk '/^Mem:/{print int($2*0.9)}')
  mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/log/slurm
  local node
  for node in "${NODES[@]}"; do mkdir -p "/var/lib/slurm/slurmd/$node"; done
  chown slurm:slurm /var/lib/slurm/slurmctld /var/log/slurm 2>/dev/null || true
  cat > /etc/slurm/slurm.conf <<CONF
# written by pycls_fast tests/slurm/cluster.sh: a two-node test cluster on one host
ClusterName=pycls_fast_test
SlurmctldHost=$HOST
SlurmUser=slurm
AuthType=auth/munge
# a requeued job may start again after cred_expire seconds (default 120)
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
KillWait=10
MinJobAge=300
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=/var/lib/slurm/slurmd/%n
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
NodeName=${NODES[0]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17101 CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17102 CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

up() {
  [ -s "$PIDS" ] && { echo "cluster.sh: $PIDS exists: run '$0 down' first"; return 1; }
  local f
  for f in $PIDFILES; do
    [ -s "$f" ] || continue
    if [ -d "/proc/$(cat "$f")" ]; then
      echo "cluster.sh: a daemon from $f is already running; not touching it"; return 1
    fi
    rm -f "$f"
  done
  write_configs
  local node
  grep -q "$HOSTS_MARK" /etc/hosts \
    || echo "127.0.0.1 ${NODES[*]} $HOSTS_MARK" >> /etc/hosts
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey -c -f -k /etc/munge/munge.key && chown munge:munge /etc/munge/munge.key
    chmod 600 /etc/munge/munge.key
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged || return 1
  wait_for 10 test -s /run/munge/munged.pid || return 1
  echo "munged $(cat /run/munge/munged.pid)" >> "$PIDS"
  rm -rf /var/lib/slurm/slurmctld/* /var/lib/slurm/slurmd/*
  slurmctld -c || return 1
  wait_for 10 test -s /run/slurmctld.pid || return 1
  echo "slurmctld $(cat /run/slurmctld.pid)" >> "$PIDS"
  for node in "${NODES[@]}"; do
    slurmd -N "$node" || return 1
    wait_for 10 test -s "/run/slurmd-$node.pid" || return 1
    echo "slurmd $(cat "/run/slurmd-$node.pid")" >> "$PIDS"
  done
  wait_for 30 sh -c '[ "$(sinfo -h -N -o %T | grep -cx idle)" = 2 ]' \
    || { echo "cluster.sh: the nodes never became idle"; sinfo -N; return 1; }
}

down() {
  squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null
  wait_for 20 sh -c '[ -z "$(squeue -h 2>/dev/null)" ]'
  if [ -s "$PIDS" ]; then
    tac "$PIDS" | while read -r name pid; do
      if [ -d "/proc/$pid" ] && grep -q "$name" "/proc/$pid/comm" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 1 40); do [ -d "/proc/$pid" ] || break; sleep 0.25; done
        [ -d "/proc/$pid" ] && kill -9 "$pid"
      fi
    done
  fi
  rm -f "$PIDS"
  # Rewritten in place: /etc/hosts may be a bind mount (a container's).
  local hosts; hosts=$(grep -v "$HOSTS_MARK" /etc/hosts)
  printf '%s\n' "$hosts" > /etc/hosts
  local f
  for f in $PIDFILES; do [ -s "$f" ] && [ ! -d "/proc/$(cat "$f")" ] && rm -f "$f"; done
  return 0
}

case "${1:-}" in
  install) install ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 install|up|down"; exit 2 ;;
esac
