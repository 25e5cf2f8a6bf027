#!/usr/bin/env bash
# Debian packages the real-component tests drive, installed when missing and we
# run as root: haproxy (2.6+) for the replica tests (tests/deploy), chromium and
# chromium-driver for the chat page's browser tests (tests/ui; selenium comes
# from the `test` extra), g++-aarch64-linux-gnu and qemu-user for the NEON
# kernels' check under emulation (tests/mlx/test_qmm_native.py).  It never fails CI: without them those tests skip,
# saying what is missing.
set -u

# --- Codex CLI (tests/agents/test_codex_cli.py): @openai/codex, pinned; installed
# with npm when `codex` is missing or another version, as root only. ---
CODEX_VERSION=0.171.0
if [ "$(codex --version 2>/dev/null)" != "codex-cli $CODEX_VERSION" ]; then
    if [ "$(id -u)" = 0 ] && command -v npm >/dev/null 2>&1; then
        if timeout 900 npm install -g --no-fund --no-audit "@openai/codex@$CODEX_VERSION" >/dev/null 2>&1; then
            echo "deps: installed @openai/codex@$CODEX_VERSION" >&2
        else
            echo "deps: npm could not install @openai/codex@$CODEX_VERSION: the Codex CLI test will skip" >&2
        fi
    else
        echo "deps: codex $CODEX_VERSION missing, and no root npm to install it:" \
             "the Codex CLI test will skip" >&2
    fi
fi
# --- end Codex CLI ---

missing=()
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null 2>&1 || missing+=(qemu-user)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "deps: ${missing[*]} missing, and no root apt-get to install them:" \
         "the tests that need them will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 900 apt-get update -qq >/dev/null \
        && timeout 900 apt-get install -y -qq "${missing[@]}" >/dev/null; then
    echo "deps: installed ${missing[*]}" >&2
else
    echo "deps: apt-get could not install ${missing[*]}: the tests that need them will skip" >&2
fi
exit 0
