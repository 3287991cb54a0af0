#!/usr/bin/env bash
# Start a throwaway PostgreSQL server on loopback for the tuner's multi-worker test.
# Installs Debian's postgresql when no server is present. Prints the database URL on stdout;
# `.ci/postgres.sh stop DATA_DIR` stops it. Trust authentication, 127.0.0.1 only, data under /tmp.
set -euo pipefail
as_pg=()
[ "$(id -u)" = 0 ] && as_pg=(runuser -u postgres --)
if [ "${1:-}" = stop ]; then
  bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  "${as_pg[@]}" "$bindir/pg_ctl" -D "$2/db" -m fast -w stop >/dev/null
  exit 0
fi
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$bindir" ]; then
  sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  { "${sudo[@]}" apt-get update -q && "${sudo[@]}" apt-get install -y -q --no-install-recommends postgresql; } >&2
  bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
fi
port=${FASTTREE_CI_PG_PORT:-54329}
data=$(mktemp -d /tmp/fasttree-pg.XXXXXX)
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system postgres
  chown postgres "$data"
fi
"${as_pg[@]}" "$bindir/initdb" -D "$data/db" -A trust -U fasttree >/dev/null
"${as_pg[@]}" "$bindir/pg_ctl" -D "$data/db" -l "$data/server.log" -w \
  -o "-c listen_addresses=127.0.0.1 -p $port -k $data" start >/dev/null
"$bindir/createdb" -h 127.0.0.1 -p "$port" -U fasttree fasttree_ci
echo "postgresql://fasttree@127.0.0.1:$port/fasttree_ci $data"
