# Sourced at the start of every command on the lent GPU machine: installs the carried wheels (.whl/) into
# /tmp/site, which comes first on PYTHONPATH, so the project's pinned versions win over the image's.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
