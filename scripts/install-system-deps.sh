#!/usr/bin/env bash
# Install the binaries the integration tests run for real: mosquitto (MQTT broker, mTLS
# and ACL tests), promtool (alert rule tests, from Debian's prometheus package), chromium
# (the status page's browser test, driven by Playwright; never `playwright install`) and, unless
# GEOFED_TEST_POSTGRES names another server, a PostgreSQL server on 127.0.0.1:5432 with
# trust authentication for local connections (the PostgreSQL state store's tests).
# Idempotent: does nothing when all are already there.
set -euo pipefail

postgres_up() {
    [ -n "${GEOFED_TEST_POSTGRES:-}" ] && return 0
    command -v pg_isready >/dev/null 2>&1 && pg_isready -q -h 127.0.0.1 -p 5432
}

missing=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# Slurm and munge: the slurm launcher's test runs its own slurmctld, slurmd and munged.
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing+=(munge)
postgres_up || command -v pg_ctlcluster >/dev/null 2>&1 || missing+=(postgresql)
if [ ${#missing[@]} -eq 0 ] && postgres_up; then
    exit 0
fi

if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "missing system packages: ${missing[*]}" >&2
        echo "install them with: sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
        exit 1
    fi
    echo "installing system packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! postgres_up; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "PostgreSQL is not running on 127.0.0.1:5432: start it (sudo service postgresql start; the tests connect as postgres with trust authentication) or set GEOFED_TEST_POSTGRES to another server's admin connection string" >&2
        exit 1
    fi
    echo "starting PostgreSQL" >&2
    service postgresql start >/dev/null
    for _ in $(seq 50); do postgres_up && break; sleep 0.2; done
    postgres_up || { echo "PostgreSQL did not start" >&2; exit 1; }
fi
