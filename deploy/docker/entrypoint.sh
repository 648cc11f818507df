#!/bin/sh
# The images' entry point: `kvcentric ARGS`. An image built for one service (KVC_SERVICE, set by its Dockerfile
# target) runs that service when ARGS are none or start with a flag, so `docker run kvcentric-decode --help` is
# `kvcentric decode --help`; any other ARGS name their own subcommand (`docker run kvcentric-engine prefill ...`).
set -e
if [ -n "${KVC_SERVICE:-}" ]; then
  case "${1:-}" in
    ""|-*) set -- "$KVC_SERVICE" "$@" ;;
  esac
fi
exec kvcentric "$@"
