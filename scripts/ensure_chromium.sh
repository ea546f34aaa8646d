#!/usr/bin/env bash
# The review app's browser test drives headless Chromium through chromedriver (Selenium, pointed at these two
# binaries, so it never downloads a browser). Debian's `chromium` and `chromium-driver` packages provide them.
# Installs them when missing and this machine can (root + apt-get); otherwise says why, and the test skips
# with that reason.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: no /usr/bin/chromium and /usr/bin/chromedriver and no way to install them (needs root" \
         "and apt-get); the browser test will be skipped, saying so" >&2
    exit 0
fi
echo "ensure_chromium: installing Debian's chromium and chromium-driver packages for the browser test"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }; then
    echo "ensure_chromium: the install failed; the browser test will be skipped, saying so" >&2
fi
