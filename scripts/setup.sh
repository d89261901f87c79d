#!/usr/bin/env bash
# Idempotent set-up: OpenGL/EGL system packages for MuJoCo rendering, a virtual environment
# in .venv, and this project installed into it (editable) with the extras named in $EXTRAS.
#
#   bash scripts/setup.sh              # runtime only
#   EXTRAS=test bash scripts/setup.sh  # plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
EXTRAS="${EXTRAS:-}"
APT_PACKAGES=(libegl1 libegl-mesa0 libgl1-mesa-dri libgl1 libglx-mesa0)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing system packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    elif command -v apt-get >/dev/null; then
        echo "setup: rendering needs the system packages ${missing[*]}; run as root:" >&2
        echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
        echo "then run this command again." >&2
        exit 1
    else
        echo "setup: this is not a Debian/Ubuntu system; install EGL and Mesa's OpenGL drivers" >&2
        echo "(the equivalents of ${APT_PACKAGES[*]}) with your package manager, then run again." >&2
        exit 1
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
spec="."
[ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
stamp="$VENV/.impala_rep-installed"
want="$(cat pyproject.toml; echo "$EXTRAS")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing impala_rep$([ -n "$EXTRAS" ] && echo "[$EXTRAS]") into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e "$spec"
    printf '%s' "$want" > "$stamp"
fi
