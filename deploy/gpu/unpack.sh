#!/usr/bin/env bash
# On the GPU machine, in the checkout: join the parts that earlier steps left in /tmp/gpu with
# this folder's own, check them, install the wheels into /tmp/site (no network needed), and put
# the shipped heads and the native module in place. Then:
#   export PYTHONPATH=$PWD:/tmp/site        (docs/gpu.md)
set -euo pipefail
here=$(dirname "$0")
mkdir -p /tmp/gpu /tmp/site
cp "$here"/part.* /tmp/gpu/
cat /tmp/gpu/part.* > /tmp/gpu/payload.tar
(cd /tmp/gpu && sha256sum -c "$OLDPWD/$here/payload.sha256" >/dev/null) || {
  echo "payload incomplete: a part did not arrive (the machine was given back?); send all parts again"; exit 1; }
tar -C /tmp/gpu -xf /tmp/gpu/payload.tar
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/gpu/*.whl
# The checkout may have travelled without the heads' weights (docs/gpu.md): the parts hold them.
cp -r /tmp/gpu/heads/. dart_client/heads/
cp /tmp/gpu/_native*.so dart_client/
echo "ready: export PYTHONPATH=$PWD:/tmp/site ; n-gram: /tmp/gpu/embedded.ngram"
