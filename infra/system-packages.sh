#!/usr/bin/env bash
# The Debian packages Kiln's test suite drives for real: a single-node Slurm cluster (slurm-wlm,
# munge), headless Chromium (the Prefect UI test) and PostgreSQL (`kiln up --database postgres`;
# its binaries live in /usr/lib/postgresql/<major>/bin, off PATH). Installed only when missing; needs root
# (or sudo) and Debian/Ubuntu's apt. `make setup` runs this; set KILN_SKIP_SYSTEM_PACKAGES=1 to
# skip it on a machine where you manage packages yourself (the tests that need them then fail
# and say which command is missing).
set -euo pipefail

[[ "${KILN_SKIP_SYSTEM_PACKAGES:-0}" == 1 ]] && exit 0

missing=()
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
[[ ${#missing[@]} -eq 0 ]] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "kiln setup: need ${missing[*]} (Debian package names) and there is no apt-get here;" \
         "install them with your package manager, or set KILN_SKIP_SYSTEM_PACKAGES=1" >&2
    exit 1
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "kiln setup: installing ${missing[*]} needs root or sudo" >&2; exit 1; }
    sudo=(sudo)
fi
echo "kiln setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq || true  # offline mirrors may refuse an update; the install can still work
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
