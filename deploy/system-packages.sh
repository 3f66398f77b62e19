#!/usr/bin/env bash
# The Debian packages the test suite uses beyond Python: Chromium for the live page's
# browser test, redis-server, which CI runs the Redis tests against a second time
# (SPEC §6), jemalloc for the embedded Redis-protocol server, and prometheus (the server
# and promtool) for the alert rules and the dashboard's queries (tests/test_prometheus.py),
# and stunnel4, the TLS proxy in front of the embedded broker (tests/test_kafka_tls.py).
# Installs only what is missing; needs root or sudo when something is.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
# jemalloc, preloaded into the embedded server (deploy/embedded/redis_server.py: jemalloc_preload).
ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2' || missing+=(libjemalloc2)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
command -v stunnel >/dev/null 2>&1 || missing+=(stunnel4)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
# Packages with a service (redis-server, prometheus) start it from their postinst where
# no policy forbids it: a Prometheus on :9090 or a Redis on :6379 left running by CI.
# The tests start their own, so deny service starts for the install (invoke-rc.d then
# skips them and succeeds), unless the machine already has such a policy.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi
echo "installing Debian packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
