"""Which project files one streaming chat request crosses, in the order it first enters them.

    python scripts/request_path.py [--model M] [--max-tokens 4] [--warmups 2]
                                   [--no-until-sample] [--json PATH] [-- SERVE FLAGS]

What runs: `jaxllm serve`'s own pieces, in this process: the engine (`make_engine`) on its
engine thread (`AsyncLLMEngine`), `ServingState.from_engine`, `build_app`, and uvicorn's
`Server` with the server's h11 protocol (serving/http_server.py) on a loopback socket, in a
thread of its own. A client on the main thread sends the request `--warmups` times (default 2),
then once more traced, all on one keep-alive connection: `POST /v1/chat/completions` with
`"stream": true`, greedy (`temperature` 0), `max_tokens` small. Two warm-ups make the traced
request the steady state: the first runs the whole prompt, the second finds it in the prefix
cache (as the traced one does), so each program these shapes need has run once and none is
compiled or loaded from the executable cache while traced. Nothing is patched; what the list
shows is what ran.

How: a profile function is installed with `threading.setprofile` before the engine is built
(so every thread the engine, the server and the tokenizer pool start has it) and with
`sys.setprofile` on the main thread; it does nothing until the traced request is sent. From
then it records each project file (under jaxllm/, serving/, pallas_kernels/) the first time any
thread enters a function of it (a call, or a generator or coroutine resuming), with the thread
and the function. Python threads already running when the hook was installed are not traced
(the server and engine start theirs after it); a thread started since that escaped the hook
is listed in `untraced_threads` (normally none).

Boundaries, precisely:
  arrival       the client starts sending the request's bytes (the connection is already open,
                as a keep-alive client's is), so the first file is the first the server enters
                for this request.
  sampled token the first return, on any thread, of a project function named `step` whose
                return value is a list holding an output of this request with at least one
                token id: the engine step that hands back the request's first sampled token
                (it includes that step's own bookkeeping: reading the token from the device,
                detokenizing, stop checks, stats).
  round trip    the client has read the whole response (`data: [DONE]` and the end of the
                chunked body), plus 0.5 s for the server to finish its side (one idle pass of
                the engine loop).
"to the sampled token" is the files first entered between arrival and the sampled token;
"back to the client" the files first entered after it; the full round trip is both, in order.
With --until-sample (the default) the count printed last is the first list's; with
--no-until-sample, the full round trip's.

Compiled programs. The model and the sampler run inside XLA programs compiled at start-up, so
their Python (jaxllm/models/, jaxllm/layers/sampler.py, ...) is not entered while a request is
served. Each program the request runs (a call of a `jax.stages.Compiled`) is recorded too, and
the project files whose lines made its operations (each operation's innermost Python frame, from
the stack frame tables of the program's HLO) are listed apart, as `compiled_until_sample` and
`compiled_round_trip`, in order of first program call. They are not in the Python lists or their
counts; `count_with_compiled` is the files to the sampled token of both kinds together.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import threading
import time
from typing import Any, Optional

PROJECT_DIRS = ("jaxllm", "serving", "pallas_kernels")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
_SOURCE_FILE = re.compile(r'source_file="([^"]+)"')
_STACK_FRAME = re.compile(r"stack_frame_id=(\d+)")
_MISSING = object()


class RequestTracer:
    """The profile function and what it recorded; inactive until `start()`."""

    def __init__(self, root: str, request_prefix: str = "chatcmpl-"):
        self.root = os.path.realpath(root)
        self.request_prefix = request_prefix
        self.active = False
        self.entries: list[dict] = []        # one per project file, in order of first entry
        self.cut: Optional[int] = None       # len(entries) when the first token came back
        self.cut_programs: Optional[int] = None  # len(programs) then
        self.programs: list[tuple[int, Any]] = []  # (len(entries) at first call, Compiled)
        self.traced_threads: set[int] = set()
        self._before: set[int] = set()  # threads running at install
        self._seen: set[str] = set()
        self._program_ids: set[int] = set()
        self._paths: dict[str, Optional[str]] = {}
        self._lock = threading.Lock()
        self._compiled_call = _compiled_call_code()

    # --- the profile function ----------------------------------------------------------------
    def hook(self, frame, event, arg) -> None:
        if not self.active:
            return
        try:
            if event == "call":
                self._on_call(frame)
            elif event == "return" and self.cut is None and frame.f_code.co_name == "step":
                self._on_step_return(frame, arg)
        except Exception:  # never disturb the traced program
            pass

    def _on_call(self, frame) -> None:
        code = frame.f_code
        if code is self._compiled_call:
            exe = frame.f_locals.get("self")
            if exe is not None and id(exe) not in self._program_ids:
                with self._lock:
                    self._program_ids.add(id(exe))
                    self.programs.append((len(self.entries), exe))
            return
        path = self.project_path(code.co_filename)
        if path is None or path in self._seen:
            return
        with self._lock:
            if path in self._seen:
                return
            self._seen.add(path)
            self.entries.append({"file": path, "thread": threading.current_thread().name,
                                 "function": code.co_qualname})

    def _on_step_return(self, frame, value) -> None:
        if self.project_path(frame.f_code.co_filename) is None:
            return
        if isinstance(value, (list, tuple)) and any(self._has_token(out) for out in value):
            with self._lock:
                if self.cut is None:
                    self.cut = len(self.entries)
                    self.cut_programs = len(self.programs)

    def _has_token(self, out) -> bool:
        rid = getattr(out, "request_id", None)
        if not isinstance(rid, str) or not rid.startswith(self.request_prefix):
            return False
        return any(len(getattr(o, "token_ids", ()) or ()) > 0 for o in out.outputs)

    def project_path(self, filename: str) -> Optional[str]:
        """`filename` relative to the repository if it is a project file, else None."""
        path = self._paths.get(filename, _MISSING)
        if path is _MISSING:
            path = None
            if filename and not filename.startswith("<"):
                rel = os.path.relpath(os.path.realpath(filename), self.root)
                if rel.split(os.sep, 1)[0] in PROJECT_DIRS:
                    path = rel.replace(os.sep, "/")
            self._paths[filename] = path
        return path

    # --- switching it on and off -------------------------------------------------------------
    def install(self) -> None:
        self._before = {t.ident for t in threading.enumerate()}
        threading.setprofile(self._thread_hook)
        sys.setprofile(self.hook)
        self.traced_threads.add(threading.get_ident())

    def _thread_hook(self, frame, event, arg) -> None:
        """What a new thread's first event sees: note the thread, then profile it for good."""
        self.traced_threads.add(threading.get_ident())
        sys.setprofile(self.hook)
        self.hook(frame, event, arg)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # threads that have the hook keep it, inactive

    def start(self) -> None:
        self.active = True

    def stop(self) -> None:
        self.active = False

    def untraced_threads(self) -> list[str]:
        """Threads started since `install` that never ran the hook (threads already running
        then, such as another engine's in the same process, serve nothing of this server)."""
        return sorted(t.name for t in threading.enumerate()
                      if t.ident not in self.traced_threads and t.ident not in self._before)

    # --- results -----------------------------------------------------------------------------
    def result(self) -> dict:
        cut = len(self.entries) if self.cut is None else self.cut
        until = self.entries[:cut]
        after = self.entries[cut:]
        compiled_until, compiled_all = self._compiled_files()
        return {
            "until_sample": [e["file"] for e in until],
            "back_to_client": [e["file"] for e in after],
            "round_trip": [e["file"] for e in self.entries],
            "entries": self.entries,
            "first_token_found": self.cut is not None,
            "count_until_sample": len(until),
            "count_round_trip": len(self.entries),
            "compiled_until_sample": compiled_until,
            "compiled_round_trip": compiled_all,
            "count_with_compiled": len(set(e["file"] for e in until) | set(compiled_until)),
            "programs_until_sample": self._programs_before_cut(),
            "programs_round_trip": len(self.programs),
        }

    def _compiled_files(self) -> tuple[list[str], list[str]]:
        until: list[str] = []
        everything: list[str] = []
        for i, (_, exe) in enumerate(self.programs):
            for path in self.program_files(exe):
                if path not in everything:
                    everything.append(path)
                if i < self._programs_before_cut() and path not in until:
                    until.append(path)
        return until, everything

    def _programs_before_cut(self) -> int:
        """Programs first called before the first token came back (all, if it never did)."""
        return len(self.programs) if self.cut_programs is None else self.cut_programs

    def program_files(self, exe) -> list[str]:
        """The project files whose lines made a compiled program's operations (each
        operation's innermost Python frame), in the order tracing first met them."""
        try:
            text = exe.as_text() or ""
        except Exception:
            return []
        files: list[str] = []
        for name in hlo_source_files(text):
            path = self.project_path(name)
            if path is not None and path not in files:
                files.append(path)
        return files


def hlo_source_files(text: str) -> list[str]:
    """The source files of an HLO module's operations: from its stack frame tables
    (`stack_frame_id=` -> StackFrames -> FileLocations -> FileNames) or, in older
    jax, the `source_file=` of each operation's metadata."""
    def table(name: str) -> dict[int, str]:
        m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
        rows = (line.split(" ", 1) for line in m.group(1).splitlines()) if m else ()
        return {int(k): v for k, v in rows if k.isdigit()}

    names = {k: v.strip('"') for k, v in table("FileNames").items()}
    locations = {k: int(m.group(1)) for k, v in table("FileLocations").items()
                 if (m := re.search(r"file_name_id=(\d+)", v))}
    frames = {k: int(m.group(1)) for k, v in table("StackFrames").items()
              if (m := re.search(r"file_location_id=(\d+)", v))}
    used = {int(x) for x in _STACK_FRAME.findall(text)}
    ids = sorted({locations[frames[f]] for f in used
                  if f in frames and frames[f] in locations})
    found = [names[i] for i in ids if i in names]
    for name in _SOURCE_FILE.findall(text):
        if name not in found:
            found.append(name)
    return found


def _compiled_call_code():
    try:
        from jax._src.stages import Compiled
        return Compiled.__call__.__code__
    except Exception:  # a jax without it: programs are not recorded
        return None


def repo_root() -> str:
    import jaxllm
    return os.path.dirname(os.path.dirname(os.path.realpath(jaxllm.__file__)))


# --- the server and the client ---------------------------------------------------------------

def start_server(model: str, server_args: list[str]):
    """`jaxllm serve MODEL` built in-process and listening on 127.0.0.1; returns
    (port, server, server thread, engine)."""
    import asyncio

    import uvicorn

    from jaxllm.config import EngineArgs
    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.deploy.data_parallel import make_engine
    from jaxllm.engine.input_processor import load_chat_template
    from serving.api_server import bind_socket, build_app, request_limits
    from serving.cli.serve import parse_args
    from serving.cli_args import chat_output_settings
    from serving.http_server import Server, h11_protocol
    from serving.state import ServingState

    args = parse_args([model, "--host", "127.0.0.1", "--port", "0", *server_args])
    engine = AsyncLLMEngine(make_engine(EngineArgs.from_cli_args(args)))
    state = ServingState.from_engine(engine, limits=request_limits(args),
                                     chat_template=load_chat_template(args.chat_template),
                                     response_role=args.response_role,
                                     log_requests=args.enable_log_requests,
                                     max_log_len=args.max_log_len,
                                     **chat_output_settings(args))
    sock = bind_socket(args.host, args.port)
    config = uvicorn.Config(build_app(state, args), log_level="warning", access_log=False,
                            http=h11_protocol(args.http_read_timeout),
                            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size)
    server = Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return sock.getsockname()[1], server, thread, engine, state


def stream_chat(conn: http.client.HTTPConnection, max_tokens: int) -> list[dict]:
    """One streaming chat completion on `conn`; its chunks (the response read to its end)."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:2000]!r}")
    chunks = []
    for line in resp.read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    return chunks


def trace_request(model: Optional[str] = None, max_tokens: int = 4,
                  server_args: Optional[list[str]] = None, settle: float = 0.5,
                  warmups: int = 2) -> dict:
    """Start the server, send the request `warmups` times, trace the next; see the module
    docstring."""
    if model is None:
        from jaxllm.config import DEFAULT_MODEL
        model = DEFAULT_MODEL
    if server_args is None:
        server_args = ["--max-model-len", "512", "--max-num-seqs", "2", "--disable-log-stats"]
    tracer = RequestTracer(repo_root())
    tracer.install()
    server = engine = state = None
    try:
        port, server, thread, engine, state = start_server(model, server_args)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        warm = [stream_chat(conn, max_tokens) for _ in range(warmups)]
        time.sleep(settle)
        untraced = tracer.untraced_threads()
        tracer.start()
        traced = stream_chat(conn, max_tokens)
        time.sleep(settle)
        tracer.stop()
        conn.close()
    finally:
        tracer.stop()
        tracer.uninstall()
        if server is not None:
            server.should_exit = True
            thread.join(timeout=10)
        if state is not None:
            state.close()
        if engine is not None:
            engine.shutdown()
    result = tracer.result()
    result.update(model=model, max_tokens=max_tokens, untraced_threads=untraced,
                  warmups=warmups, text=_text(traced), warm_texts=[_text(w) for w in warm])
    return result


def _text(chunks: list[dict]) -> str:
    return "".join((c["choices"][0]["delta"].get("content") or "")
                   for c in chunks if c.get("choices"))


def format_result(r: dict, until_sample: bool = True) -> str:
    entries = r["entries"]
    cut = r["count_until_sample"]
    lines = [f"model {r['model']}, max_tokens {r['max_tokens']}, {r['warmups']} warm-ups, "
             f"streamed text {r['text']!r}"]
    if not r["first_token_found"]:
        lines.append("WARNING: no engine step returned a token for the request: the list "
                     "below is the whole round trip")
    if r["untraced_threads"]:
        lines.append(f"WARNING: threads running untraced: {', '.join(r['untraced_threads'])}")

    def block(title, items, offset):
        lines.append(title)
        for i, e in enumerate(items, offset + 1):
            lines.append(f"  {i:2d}. {e['file']:<45} {e['thread']:<16} {e['function']}")

    block(f"To the sampled token ({cut} files):", entries[:cut], 0)
    block(f"Back to the client ({len(entries) - cut} more files):", entries[cut:], cut)
    lines.append(f"Inside the compiled programs run to the sampled token "
                 f"({r['programs_until_sample']} programs, not counted above):")
    lines += [f"      {f}" for f in r["compiled_until_sample"]]
    extra = [f for f in r["compiled_round_trip"] if f not in r["compiled_until_sample"]]
    if extra:
        lines.append("Inside the compiled programs run after it:")
        lines += [f"      {f}" for f in extra]
    lines.append(f"full round trip: {r['count_round_trip']} files")
    lines.append(f"to the sampled token: {r['count_until_sample']} files "
                 f"({r['count_with_compiled']} with the compiled programs' files)")
    count = r["count_until_sample"] if until_sample else r["count_round_trip"]
    lines.append(f"count ({'to the sampled token' if until_sample else 'full round trip'}): "
                 f"{count}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: jaxllm's default model")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--warmups", type=int, default=2,
                   help="untraced requests sent first (the same request; default 2)")
    p.add_argument("--until-sample", action=argparse.BooleanOptionalAction, default=True,
                   help="count the files to the first sampled token (default), or the whole "
                        "round trip (--no-until-sample); both lists are printed")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after `--`: `jaxllm serve` flags replacing the defaults "
                        "(--max-model-len 512 --max-num-seqs 2 --disable-log-stats)")
    a = p.parse_args(argv)
    serve_args = [x for x in a.serve_args if x != "--"] or None
    r = trace_request(a.model, a.max_tokens, serve_args, warmups=a.warmups)
    print(format_result(r, a.until_sample))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**r, "count": r["count_until_sample"] if a.until_sample
                       else r["count_round_trip"]}, f, indent=1)
    return 0 if r["first_token_found"] else 1


if __name__ == "__main__":
    sys.exit(main())
