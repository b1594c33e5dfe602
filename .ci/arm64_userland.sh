#!/usr/bin/env bash
# An arm64 Python for tests/test_portable.py, run under qemu-aarch64: Debian's python3.11 for
# arm64 and the libraries it needs, unpacked into DEST/root (downloaded, never installed), and
# the runtime's aarch64 wheels from PyPI in DEST/site, at the versions this environment has.
#   bash .ci/arm64_userland.sh DEST      (needs root for apt; PYTHON: the environment's python)
set -euo pipefail
dest=$(realpath -m "${1:?usage: arm64_userland.sh DEST}")
python=${PYTHON:-python}
if [ -x "$dest/root/usr/bin/python3.11" ] && [ -d "$dest/site/onnxruntime" ]; then
    exit 0  # made before
fi
dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
apt-get update -qq
rm -rf "$dest" && mkdir -p "$dest/debs" "$dest/root"
packages=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
               --no-replaces --no-enhances python3.11-minimal:arm64 libpython3.11-stdlib:arm64 \
               libstdc++6:arm64 libgcc-s1:arm64 | grep -E '^[a-z0-9].*:arm64$' | sort -u)
(cd "$dest/debs" && apt-get download -qq $packages)
for deb in "$dest"/debs/*.deb; do dpkg -x "$deb" "$dest/root"; done
rm -rf "$dest/debs"
pins=$("$python" - <<'PY'
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in
               ("numpy", "onnxruntime", "tokenizers", "click", "platformdirs", "jinja2")))
PY
)
"$python" -m pip install --quiet --no-deps --target "$dest/site" --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux2014_aarch64 --python-version 3.11 --implementation cp \
    $pins markupsafe flatbuffers packaging
