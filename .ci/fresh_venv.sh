#!/usr/bin/env bash
# A new user's first hour, on the plain install (no test extras, so no torch): the README's
# run command, an offline LLM().chat and a chat completion from `jaxllm serve`, each answering
# Paris; every module of the package imports; and the run command's own stderr holds only
# jaxllm's log lines (no other library's notices, no progress bars).
# Usage: .ci/fresh_venv.sh RUN_COMMAND (the README's run command line).
set -euo pipefail
run="$1"
dir=$(mktemp -d)
venv="$dir/venv"
python -m venv "$venv"
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
fail() { echo "fresh venv: $1"; for f in "$dir"/*.log; do echo "--- $f"; tail -40 "$f"; done; exit 1; }

# The run command, its parts in order: pip's output to a log, the jaxllm part's stderr kept.
IFS=$'\n' read -r -d '' -a parts < <(echo "$run" | sed 's/ && /\n/g'; printf '\0')
for part in "${parts[@]}"; do
  echo "+ (fresh venv) $part"
  if [[ "$part" == pip* ]]; then
    bash -c "$part" >>"$dir/pip.log" 2>&1 || fail "pip failed"
  else
    bash -c "$part" >"$dir/run.out" 2>"$dir/run.log" || fail "run command failed"
  fi
done
tail -3 "$dir/run.out"
grep -q Paris "$dir/run.out" || fail "run command: no Paris"
# jaxllm's log lines look like "INFO 11-28 04:21:00 [jaxllm...] ..."
others=$(grep -v -E '^(DEBUG|INFO|WARNING|ERROR|CRITICAL) [0-9-]+ [0-9:]+ \[jaxllm' \
  "$dir/run.log" || true)
[ -z "$others" ] || fail "the run command's stderr has lines not from jaxllm's log: ${others:0:500}"

echo "+ (fresh venv) every module imports"
python - <<'PY' || fail "a module does not import on the plain install"
import importlib, pkgutil
for top in ("jaxllm", "serving", "pallas_kernels"):
    for m in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
        importlib.import_module(m.name)
PY

echo "+ (fresh venv) LLM().chat"
python - >"$dir/chat.out" 2>"$dir/chat.log" <<'PY' || fail "offline chat failed"
from jaxllm import LLM, SamplingParams
out = LLM().chat([{"role": "user", "content": "What is the capital of France?"}],
                 SamplingParams(temperature=0, max_tokens=32))
print(out[0].outputs[0].text)
PY
cat "$dir/chat.out"
grep -q Paris "$dir/chat.out" || fail "offline chat: no Paris"

echo "+ (fresh venv) jaxllm serve + a chat completion"
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
jaxllm serve --host 127.0.0.1 --port "$port" >"$dir/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
python - "$port" >"$dir/serve_chat.out" 2>>"$dir/serve.log" <<'PY' || fail "server chat failed"
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.time() + 600
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=5)
        break
    except OSError:
        if time.time() > deadline:
            raise SystemExit("no /health 200 within 600 s")
        time.sleep(1)
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 32}
req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]["content"])
PY
cat "$dir/serve_chat.out"
grep -q Paris "$dir/serve_chat.out" || fail "server chat: no Paris"
kill "$server"
wait "$server" 2>/dev/null || true
trap - EXIT
rm -rf "$dir"
