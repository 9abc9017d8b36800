#!/bin/bash
# Launch agent of the simulated hosts (tests/multihost): ssh's stand-in.
#
#   agent.sh HOST COMMAND [ARGS ...]
#
# Runs COMMAND on simulated host HOST, i.e. inside the network namespace
# ${MULTIHOST_NS_PREFIX}HOST, in a new UTS namespace whose hostname is HOST,
# with MULTIHOST_HOSTS_FILE bind-mounted over /etc/hosts and HOST's own
# directory MULTIHOST_SHM_DIR/HOST over /dev/shm (`ip netns exec` gives the
# command its own mount namespace, so none of it leaks out).  The host's
# /dev/shm lasts as long as the simulated hosts, like a machine's: what a
# killed job leaves there (Open MPI's segments, ours) goes when the hosts
# are torn down, not into the real /dev/shm.  Like ssh, it joins COMMAND and
# ARGS with spaces and hands them to a shell: Open MPI (`--mca
# plm_rsh_agent agent.sh`) passes the orted command line that way.
# tests/multihost/hosts.py sets the variables.
set -eu

if [[ "${1:-}" == --inside ]]; then
  host=$2
  shift 2
  hostname "$host"
  mount --bind "$MULTIHOST_HOSTS_FILE" /etc/hosts
  mount --bind "$MULTIHOST_SHM_DIR/$host" /dev/shm
  exec /bin/sh -c "$*"
fi

if [[ $# -lt 2 ]]; then
  echo "usage: $0 HOST COMMAND [ARGS ...]" >&2
  exit 2
fi
: "${MULTIHOST_NS_PREFIX:?agent.sh: MULTIHOST_NS_PREFIX is not set}"
: "${MULTIHOST_HOSTS_FILE:?agent.sh: MULTIHOST_HOSTS_FILE is not set}"
: "${MULTIHOST_SHM_DIR:?agent.sh: MULTIHOST_SHM_DIR is not set}"
host=$1
shift
# A host the test marked as gone (SimulatedHosts.set_gone) does not answer,
# like ssh to a crashed machine.
if [[ -n "${MULTIHOST_GONE_DIR:-}" && -e "$MULTIHOST_GONE_DIR/$host" ]]; then
  echo "agent.sh: $host: host is gone (simulated)" >&2
  exit 255
fi
exec ip netns exec "${MULTIHOST_NS_PREFIX}${host}" \
  unshare --uts -- "$0" --inside "$host" "$@"
