#!/bin/sh
# One Redis Sentinel of the StatefulSet redis-sentinel: it watches the primary named kvcentric (the one the Sentinels
# already name, else redis-0.redis-headless) with a quorum of 2 of 3, announces its stable name and fails the primary
# over to a replica 5 s after it stops answering. A Sentinel rewrites its config file, so it is written to the
# writable SENTINEL_DIR (an emptyDir). With REDISCLI_AUTH (the secure component) it authenticates to the servers
# and asks its own clients (kvs-meta) for the same password.
set -eu
master="${MASTER_NAME:-kvcentric}"
primary=$(redis-cli -h "${SENTINEL_HOST:-redis-sentinel}" -p "${SENTINEL_PORT:-26379}" --raw \
  sentinel get-master-addr-by-name "$master" 2>/dev/null | head -1) || primary=""
[ -n "$primary" ] || primary="${FIRST_PRIMARY:-redis-0.redis-headless}"
conf="${SENTINEL_DIR:-/data}/sentinel.conf"
{
  echo "port ${SENTINEL_PORT:-26379}"
  echo "protected-mode no"
  echo "sentinel resolve-hostnames yes"
  echo "sentinel announce-hostnames yes"
  echo "sentinel announce-ip $(hostname).redis-sentinel-headless"
  echo "sentinel monitor $master $primary 6379 2"
  echo "sentinel down-after-milliseconds $master 5000"
  echo "sentinel failover-timeout $master 30000"
  if [ -n "${REDISCLI_AUTH:-}" ]; then
    echo "sentinel auth-pass $master $REDISCLI_AUTH"
    echo "requirepass $REDISCLI_AUTH"
  fi
} > "$conf"
exec "${REDIS_SERVER:-redis-server}" "$conf" --sentinel
