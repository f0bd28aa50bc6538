# Source on a TPU VM without network, from the checkout's root, after copying the folder that
# `python scripts/tpu_wheels.py` wrote (default .whl-tpu) beside it:
#
#   source scripts/tpu_setup.sh [WHEEL_DIR]
#
# Installs the wheels (and the names in WHEEL_DIR/from_index.txt, from the VM's own package index,
# $MESHDISTILL_PIP_INDEX, default file:///opt/pypi/simple) into $MESHDISTILL_SITE (default
# ${TMPDIR:-/tmp}/meshdistill-site) without dependencies, then appends that folder and the checkout's src/ to
# PYTHONPATH: the VM's own jax, jaxlib and libtpu stay first. Nothing is installed system-wide. Returns non-zero,
# naming the step, when an install fails. See docs/tpu.md.
_md_wheels="${1:-.whl-tpu}"
_md_site="${MESHDISTILL_SITE:-${TMPDIR:-/tmp}/meshdistill-site}"
_md_index="${MESHDISTILL_PIP_INDEX:-file:///opt/pypi/simple}"
if ! ls "$_md_wheels"/*.whl >/dev/null 2>&1; then
  echo "tpu_setup: no wheels in $_md_wheels; run 'python scripts/tpu_wheels.py' on a machine with network first" >&2
  return 2 2>/dev/null || exit 2
fi
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$_md_site" "$_md_wheels"/*.whl \
  || { echo "tpu_setup: installing the wheels of $_md_wheels failed" >&2; return 1 2>/dev/null || exit 1; }
if [ -s "$_md_wheels/from_index.txt" ]; then
  # shellcheck disable=SC2046
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
    --only-binary=:all: --index-url "$_md_index" --upgrade --target "$_md_site" $(cat "$_md_wheels/from_index.txt") \
    || { echo "tpu_setup: installing $(tr '\n' ' ' < "$_md_wheels/from_index.txt")from $_md_index failed" >&2;
         return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_md_site:$PWD/src"
export PATH="$_md_site/bin:$PATH"
echo "tpu_setup: $(ls "$_md_wheels"/*.whl | wc -l) wheels in $_md_site; PYTHONPATH ends with $_md_site:$PWD/src"
unset _md_wheels _md_site _md_index
