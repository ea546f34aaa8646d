#!/usr/bin/env bash
# The deployment test starts a throwaway PostgreSQL cluster of its own; it needs the server binaries, which
# Debian's `postgresql` package provides. Installs them when missing and this machine can (root + apt-get);
# otherwise says why, and the test skips with that reason.
set -euo pipefail
if command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_postgres: no PostgreSQL server binaries and no way to install them (needs root and apt-get);" \
         "the deployment test will be skipped, saying so" >&2
    exit 0
fi
echo "ensure_postgres: installing Debian's postgresql package for the deployment test"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null; }; then
    echo "ensure_postgres: the install failed; the deployment test will be skipped, saying so" >&2
fi
