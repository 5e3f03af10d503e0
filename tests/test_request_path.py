"""scripts/request_path.py on the default model: one streaming chat request through the real
server (engine thread, uvicorn, the app), traced file by file (issue 43). The count is printed,
not bounded: the path is being shortened."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))

import request_path  # noqa: E402

SAMPLER = "jaxllm/layers/sampler.py"


def test_streaming_chat_request_path():
    r = request_path.trace_request(max_tokens=2)
    print("\n" + request_path.format_result(r))
    until, full = r["until_sample"], r["round_trip"]
    assert r["first_token_found"], r
    assert r["text"] and r["warm_texts"] == [r["text"]] * 2  # greedy: the same answer
    # Threads started before the tracer (tqdm's monitor, say) are not traced: none of ours.
    assert not [t for t in r["untraced_threads"] if t.startswith(("jaxllm", "tokenizer"))], r
    assert until and until[0].startswith("serving/"), until
    assert "serving/api_server.py" in until
    assert len(full) == len(set(full)), full
    assert full[:len(until)] == until and until + r["back_to_client"] == full
    # The token is drawn inside a compiled program: sampler.py's Python runs only at compile
    # time, so it is found among the files of the programs the request ran.
    assert SAMPLER in until + r["compiled_until_sample"], r
    assert "jaxllm/worker/model_runner.py" in until
    assert all(f.split("/")[0] in request_path.PROJECT_DIRS
               for f in full + r["compiled_round_trip"])
