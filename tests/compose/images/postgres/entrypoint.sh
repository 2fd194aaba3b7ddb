#!/bin/bash
# First start: initdb, the user and database of POSTGRES_USER / POSTGRES_DB with POSTGRES_PASSWORD
# (scram), connections from the network; then the server in the foreground.
set -euo pipefail
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}"
user=${POSTGRES_USER:-postgres} db=${POSTGRES_DB:-${POSTGRES_USER:-postgres}}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  initdb -D "$PGDATA" -U postgres --auth-local=trust --auth-host=scram-sha-256 > /dev/null
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -c unix_socket_directories=/tmp" -w start > /dev/null
  psql -h /tmp -U postgres -v ON_ERROR_STOP=1 -q \
    -c "CREATE ROLE \"$user\" LOGIN SUPERUSER PASSWORD '${POSTGRES_PASSWORD//\'/\'\'}'" 2>/dev/null \
    || psql -h /tmp -U postgres -q -c "ALTER ROLE \"$user\" PASSWORD '${POSTGRES_PASSWORD//\'/\'\'}'"
  [ "$db" = postgres ] || psql -h /tmp -U postgres -q -c "CREATE DATABASE \"$db\" OWNER \"$user\""
  pg_ctl -D "$PGDATA" -m fast -w stop > /dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/tmp
