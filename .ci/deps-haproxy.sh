#!/usr/bin/env bash
# The replica tests (tests/deploy) run real afm serve replicas behind a real
# haproxy (2.6+; Debian 12's package).  This installs it when it is missing and
# we run as root.  It never fails CI: without it those tests skip, saying so.
set -u
if command -v haproxy >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "deps-haproxy: haproxy missing, and no root apt-get to install it:" \
         "the replica tests (tests/deploy) will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 900 apt-get update -qq >/dev/null \
        && timeout 900 apt-get install -y -qq haproxy >/dev/null; then
    echo "deps-haproxy: installed $(haproxy -v 2>/dev/null | head -n 1)" >&2
else
    echo "deps-haproxy: apt-get could not install haproxy: the replica tests (tests/deploy) will skip" >&2
fi
exit 0
