#!/bin/sh
# One server of the StatefulSet redis (redis-0, redis-1, redis-2), started as the primary or as a replica of it: the
# primary is the one the Sentinels name (after a failover, not necessarily redis-0); where no Sentinel answers yet
# (the set's first start) redis-0 is the primary and the others follow it. Every server announces its stable name
# <pod>.redis-headless, so the Sentinels and kvs-meta find a new primary by name. REDIS_CONF: a config file read
# first (the secure component's, with the password); REDISCLI_AUTH: the password redis-cli asks the Sentinels with.
set -eu
master="${MASTER_NAME:-kvcentric}"
me="$(hostname).redis-headless"
primary=$(redis-cli -h "${SENTINEL_HOST:-redis-sentinel}" -p "${SENTINEL_PORT:-26379}" --raw \
  sentinel get-master-addr-by-name "$master" 2>/dev/null | head -1) || primary=""
[ -n "$primary" ] || primary="${FIRST_PRIMARY:-redis-0.redis-headless}"
if [ "$primary" = "$me" ]; then
  set --
else
  set -- --replicaof "$primary" 6379
fi
# Protected mode off: the other pods must reach it (the NetworkPolicies say which; the secure component adds a password).
# shellcheck disable=SC2086  # REDIS_CONF is one path or nothing
exec "${REDIS_SERVER:-redis-server}" ${REDIS_CONF:-} --save "" --appendonly no --protected-mode no \
  --replica-announce-ip "$me" "$@"
