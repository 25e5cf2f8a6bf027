#!/usr/bin/env bash
# Debian packages the real-component tests drive, installed when missing and we
# run as root: haproxy (2.6+) for the replica tests (tests/deploy), chromium and
# chromium-driver for the chat page's browser tests (tests/ui; selenium comes
# from the `test` extra), g++-aarch64-linux-gnu and qemu-user for the NEON
# kernels' check under emulation (tests/mlx/test_qmm_native.py); and, from npm,
# the Claude Code and Codex CLIs and (from PyPI, in its own venv) lm-eval for
# the agent tests (tests/agents).  It never fails CI:
# without them those tests skip, saying what is missing.
set -u

# ---- Claude Code (tests/agents/test_claude_code.py) ---------------------------
# The pinned CLI from npm when `claude` is missing and we run as root (npm's
# nodejs from apt first if there is no npm); without it those tests skip.
CLAUDE_CODE_VERSION=2.1.197
if ! command -v claude >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "deps: claude missing, and not root to install it: tests/agents/test_claude_code.py will skip" >&2
    else
        if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
            DEBIAN_FRONTEND=noninteractive timeout 900 apt-get update -qq >/dev/null \
                && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq nodejs npm >/dev/null
        fi
        if command -v npm >/dev/null 2>&1 \
                && timeout 900 npm install -g --no-fund --no-audit -q \
                    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >/dev/null 2>&1; then
            # the postinstall puts the native binary in place; run it if npm skipped scripts
            claude --version >/dev/null 2>&1 || (cd "$(npm root -g)/@anthropic-ai/claude-code" \
                && node install.cjs >/dev/null 2>&1)
        fi
        if claude --version >/dev/null 2>&1; then
            echo "deps: installed Claude Code $CLAUDE_CODE_VERSION" >&2
        else
            echo "deps: npm could not install Claude Code: tests/agents/test_claude_code.py will skip" >&2
        fi
    fi
fi
# ---- end Claude Code ------------------------------------------------------------

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

# ---- lm-evaluation-harness (tests/agents/test_lm_eval.py) -----------------------
# Pinned, in a virtual environment of its own (it brings torch: the CPU build
# from the registry, ~1.6 GB, about a minute), linked onto PATH; as root only.
LM_EVAL_VERSION=0.4.13
if ! command -v lm_eval >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v python3 >/dev/null 2>&1; then
        if python3 -m venv /opt/lm-eval >/dev/null 2>&1 \
                && timeout 1200 /opt/lm-eval/bin/pip install -q "lm_eval[api]==$LM_EVAL_VERSION" \
                    "torch==2.13.0" >/dev/null 2>&1 \
                && ln -sf /opt/lm-eval/bin/lm_eval /usr/local/bin/lm_eval; then
            echo "deps: installed lm_eval $LM_EVAL_VERSION in /opt/lm-eval" >&2
        else
            echo "deps: could not install lm_eval: tests/agents/test_lm_eval.py will skip" >&2
        fi
    else
        echo "deps: lm_eval missing, and not root to install it: tests/agents/test_lm_eval.py will skip" >&2
    fi
fi
# ---- end lm-evaluation-harness ----------------------------------------------------

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
