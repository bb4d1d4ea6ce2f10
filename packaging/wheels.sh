#!/usr/bin/env bash
# Builds the `ringtmp` wheels (x86-64, and aarch64 with the cross linker of .cargo/config.toml)
# with maturin, installs the x86-64 one into a fresh virtual environment and runs the README's
# main command from it (in an empty directory: the datasets come from the wheel), and runs the
# aarch64 one's binary under qemu-user. Wheels land in target/wheels/.
#
#   packaging/wheels.sh            (TARGETS="x86_64 aarch64" by default)
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=${TARGETS:-"x86_64 aarch64"}
root=$PWD
# The bundled datasets the wheel carries (the default run's MNIST, the digits, the text corpus).
rm -rf target/wheel-data
mkdir -p target/wheel-data/data/share/ringtmp/data
cp -r data/mnist data/sklearn-digits data/shakespeare data/README.md \
    target/wheel-data/data/share/ringtmp/data/
# maturin itself, from PyPI, in a virtual environment of its own.
if [ ! -x target/maturin-venv/bin/maturin ]; then
    python3 -m venv target/maturin-venv
    target/maturin-venv/bin/pip install -q "maturin>=1.7,<2"
fi
rm -rf target/wheels
for arch in $TARGETS; do
    # The host's wheel without --target: cargo then reuses target/release, which the README's
    # build (and CI's) made already; a named target builds everything again in its own folder.
    target=()
    [ "$arch" = "$(uname -m)" ] || target=(--target "$arch-unknown-linux-gnu")
    target/maturin-venv/bin/maturin build --release --quiet "${target[@]}" --out target/wheels
done
ls -l target/wheels
if [[ " $TARGETS " == *" x86_64 "* ]]; then
    rm -rf target/wheel-venv
    python3 -m venv target/wheel-venv
    target/wheel-venv/bin/pip install -q target/wheels/ringtmp-*x86_64*.whl
    run=$(mktemp -d)
    # The README's main command, as a pip user runs it: no repository, no cargo.
    (cd "$run" && PATH="$root/target/wheel-venv/bin:$PATH" ringtmp train \
        --out "$run/run")
    python3 - "$run/run/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["final_test_accuracy"] > 0.9, s["final_test_accuracy"]
print(f"wheel: ringtmp train from a fresh venv: {100 * s['final_test_accuracy']:.2f}% "
      f"on {s['nodes']} nodes")
PY
    rm -rf "$run"
fi
if [[ " $TARGETS " == *" aarch64 "* ]]; then
    unpacked=$(mktemp -d)
    python3 -m zipfile -e target/wheels/ringtmp-*aarch64*.whl "$unpacked"
    bin=$(find "$unpacked" -path '*scripts/ringtmp' | head -1)
    chmod +x "$bin"
    qemu-aarch64-static -L /usr/aarch64-linux-gnu "$bin" --version
    test -f "$(find "$unpacked" -path '*share/ringtmp/data/mnist/*' | head -1)"
    echo "wheel: the aarch64 binary runs under qemu-user and carries the datasets"
    rm -rf "$unpacked"
fi
