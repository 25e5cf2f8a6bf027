#!/usr/bin/env bash
# The chat page's browser tests (tests/ui) drive Debian's chromium through
# chromium-driver with selenium (selenium comes from the `test` extra).  This
# installs the two packages when they are missing and we run as root.  It never
# fails CI: without them the browser tests skip, saying what is missing.
set -u
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "deps-browser: chromium or chromedriver missing, and no root apt-get to install them:" \
         "the chat page's browser tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 900 apt-get update -qq >/dev/null \
        && timeout 900 apt-get install -y -qq chromium chromium-driver >/dev/null; then
    echo "deps-browser: installed chromium and chromium-driver" >&2
else
    echo "deps-browser: apt-get could not install chromium and chromium-driver:" \
         "the chat page's browser tests will skip" >&2
fi
exit 0
