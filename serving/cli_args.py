"""`jaxllm serve` front-end flags (names and defaults as `vllm serve`) and `--config FILE.yaml`.

Kept free of heavy imports: `jaxllm serve --help` builds its parser from this module.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Optional

from jaxllm.entrypoints.media import MediaPolicy


def _json_list(value: str) -> list:
    out = json.loads(value)
    if not isinstance(out, list):
        raise ValueError(value)
    return out


_json_list.__name__ = "JSON list"  # argparse's message: "invalid JSON list value: ..."


def _at_least(minimum, kind):
    """An argparse type refusing values below `minimum` (argparse's error names the flag)."""
    def parse(value: str):
        out = kind(value)
        if not out >= minimum:  # NaN too
            raise ValueError(value)
        return out

    parse.__name__ = f"{kind.__name__} >= {minimum}"
    return parse


_positive_int, _count, _seconds = _at_least(1, int), _at_least(0, int), _at_least(0.001, float)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server arguments")
    g.add_argument("--config", metavar="FILE.yaml",
                   help="YAML file of these options (keys as the flags, without '--'); flags "
                        "given on the command line win.")
    g.add_argument("--host", default=None, help="Host name to bind (default: all interfaces).")
    g.add_argument("--port", type=int, default=8000, help="Port number.")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"],
                   help="Log level for uvicorn.")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="Disable uvicorn's access log.")
    g.add_argument("--allow-credentials", action="store_true", help="Allow CORS credentials.")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='Allowed CORS origins, as a JSON list (default ["*"]).')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help='Allowed CORS methods, as a JSON list (default ["*"]).')
    g.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help='Allowed CORS headers, as a JSON list (default ["*"]).')
    g.add_argument("--api-key", default=None,
                   help="If set (or $VLLM_API_KEY, or $JAXLLM_API_KEY), every route but "
                        "/health, /ping and /metrics requires 'Authorization: Bearer <key>'.")
    g.add_argument("--chat-template", default=None,
                   help="Chat template: a file path or the Jinja template itself (default: the "
                        "tokenizer's).")
    g.add_argument("--response-role", default="assistant",
                   help="Role of generated chat messages when add_generation_prompt is true.")
    g.add_argument("--ssl-keyfile", default=None, help="SSL key file.")
    g.add_argument("--ssl-certfile", default=None, help="SSL certificate file.")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates file.")
    g.add_argument("--root-path", default=None,
                   help="FastAPI root_path, when the app is behind a path-based proxy.")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="Answer with an X-Request-Id header, and take the request id from the "
                        "client's X-Request-Id (at most 128 printable ASCII characters).")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="Disable /docs, /redoc and /openapi.json.")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                   default=False, help="Log request ids and parameters (prompts at DEBUG).")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="[Deprecated, as in vLLM] requests are not logged unless "
                        "--enable-log-requests.")
    g.add_argument("--max-log-len", type=_count, default=None,
                   help="Most characters (or token ids) of any value in request logs.")
    g.add_argument("--lora-modules", type=lora_module, nargs="+", action="extend",
                   default=None, metavar="NAME=PATH|JSON",
                   help='LoRA adapters served under their own model names (needs '
                        '--enable-lora): each `name=path` or a JSON object {"name": ..., '
                        '"path": ..., "base_model_name": ...}. A request chooses one by '
                        'its `model` field.')
    add_limit_args(parser)
    add_chat_output_args(parser)
    add_media_args(parser)
    return parser


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules value (vLLM's LoRAModulePath)."""
    name: str
    path: str
    base_model_name: Optional[str] = None


_LORA_MODULE_KEYS = ("name", "path", "base_model_name")


def lora_module(value: str) -> LoRAModulePath:
    """`name=path` or a JSON object, as vLLM's --lora-modules; argparse names the flag and the
    value it refuses, a ValueError's message says why."""
    if "=" in value and "," not in value and not value.lstrip().startswith("{"):
        name, path = value.split("=", 1)
        if not name or not path:
            raise argparse.ArgumentTypeError(f"{value!r}: expected name=path")
        return LoRAModulePath(name, path)
    try:
        spec = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected name=path or a JSON object") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"{value!r}: expected name=path or a JSON object")
    unknown = sorted(set(spec) - set(_LORA_MODULE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"{value!r}: unknown field {unknown[0]!r} (fields: "
                                         f"{', '.join(_LORA_MODULE_KEYS)})")
    for key in ("name", "path"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise argparse.ArgumentTypeError(f"{value!r}: {key!r} must be a non-empty string")
    base = spec.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"{value!r}: 'base_model_name' must be a string")
    return LoRAModulePath(spec["name"], spec["path"], base)


def lora_modules(args: argparse.Namespace, served_model_names: list[str],
                 enable_lora: bool) -> list[LoRAModulePath]:
    """The --lora-modules to register at start-up, after the rules a ValueError names: they
    need --enable-lora, their names are unique and not a served model's, and a
    base_model_name is one of the served names."""
    modules = list(args.lora_modules or [])
    if modules and not enable_lora:
        raise ValueError("--lora-modules requires --enable-lora")
    seen: set[str] = set()
    for m in modules:
        if m.name in served_model_names:
            raise ValueError(f"--lora-modules {m.name}: the name is a served model name "
                             f"(--served-model-name); choose another")
        if m.name in seen:
            raise ValueError(f"--lora-modules {m.name}: the name is given twice")
        seen.add(m.name)
        if m.base_model_name is not None and m.base_model_name not in served_model_names:
            raise ValueError(f"--lora-modules {m.name}: base_model_name "
                             f"{m.base_model_name!r} is not a served model name "
                             f"({', '.join(served_model_names)})")
    return modules


# vLLM's names; tests/test_chat_tools.py checks them against the parser registries (importing
# those here would make `jaxllm serve --help` import the package).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "openai", "llama4_json",
                     "llama4_pythonic", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2",
                     "glm45", "granite")
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss", "deepseek_v3", "glm45", "granite")
HARMONY_PARSERS = ("openai", "openai_gptoss")  # GPT-OSS's (jaxllm/entrypoints/harmony.py)
CONTENT_FORMATS = ("auto", "string", "openai")


def add_chat_output_args(parser: argparse.ArgumentParser) -> None:
    """Tool calling and reasoning output of /v1/chat/completions, as `vllm serve`."""
    g = parser.add_argument_group("tool calling and reasoning")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Let requests use tool_choice "auto" (and tools without tool_choice): '
                        "the model's tool calls are parsed from its text with "
                        "--tool-call-parser, which this needs.")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="The tool-call format of the model (vLLM's names): "
                        f"{', '.join(TOOL_CALL_PARSERS)}, or one a --tool-parser-plugin "
                        "registers.")
    g.add_argument("--tool-parser-plugin", default="", metavar="PATH",
                   help="A Python file registering tool parsers with ToolParserManager."
                        "register_module (jaxllm.entrypoints.openai_parsers.tool_parsers), "
                        "loaded at start-up; name one with --tool-call-parser.")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='Leave the tools out of the prompt when tool_choice is "none".')
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="Split the model's reasoning (<think>...</think>) from its answer into "
                        "the message's `reasoning` field.")
    g.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                   help="How message content reaches the chat template: 'string' (text parts "
                        "joined), 'openai' (a list of {type, text} parts) or 'auto' (what the "
                        "template iterates over).")


def chat_output_settings(args: argparse.Namespace) -> dict:
    """The ServingState fields of these flags, after vLLM's start-up rules (a ValueError
    names the flag)."""
    if args.tool_parser_plugin or args.tool_call_parser:
        check_tool_call_parser(args.tool_parser_plugin, args.tool_call_parser)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    for flag, value in (("--tool-call-parser", args.tool_call_parser),
                        ("--reasoning-parser", args.reasoning_parser)):
        if value in HARMONY_PARSERS:  # they need openai-harmony and its vocabulary: now
            from jaxllm.entrypoints.harmony import HarmonyUnavailable, encoding
            try:
                encoding()
            except HarmonyUnavailable as e:
                raise ValueError(f"{flag} {value}: {e}") from None
    return {**{name: getattr(args, name) for name in (
        "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser",
        "exclude_tools_when_tool_choice_none", "chat_template_content_format")},
        "media": media_policy(args)}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """Per-request bounds, HTTP limits, overload and shutdown."""
    g = parser.add_argument_group("limits")
    g.add_argument("--max-n-sequences", type=_positive_int,
                   default=int(os.environ.get("VLLM_MAX_N_SEQUENCES", 256)),
                   help="Most sequences one request may start (n x prompts); default "
                        "$VLLM_MAX_N_SEQUENCES or 256.")
    g.add_argument("--max-stop-strings", type=_positive_int, default=64,
                   help="Most stop strings in one request.")
    g.add_argument("--max-logit-bias", type=_positive_int, default=1024,
                   help="Most logit_bias entries in one request.")
    g.add_argument("--max-request-body-size", type=_positive_int, default=16 * 1024**2,
                   help="Largest request body in bytes (413 beyond).")
    g.add_argument("--h11-max-incomplete-event-size", type=_positive_int, default=64 * 1024,
                   help="Largest request line plus headers in bytes.")
    g.add_argument("--h11-max-header-count", type=_positive_int, default=256,
                   help="Most headers in one request (431 beyond).")
    g.add_argument("--http-read-timeout", type=_seconds, default=30.0,
                   help="Seconds a client may take to send its headers, or between two parts "
                        "of its body, before the connection is closed (slow clients).")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Let requests bring their own chat_template (refused otherwise).")
    g.add_argument("--chat-template-timeout", type=_seconds, default=2.0,
                   help="Seconds a chat template may take to render (400 beyond).")
    g.add_argument("--max-waiting-requests", type=_count, default=None,
                   help="Most sequences admitted beyond --max-num-seqs; more get 503 with "
                        "Retry-After (default: no cap).")
    g.add_argument("--shutdown-timeout", type=_at_least(0, float), default=30.0,
                   help="On SIGTERM/SIGINT, seconds in-flight requests may take to finish "
                        "before they are cancelled; the server then exits 0.")


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Replace `--config FILE` by the flags it holds, placed first so the command line wins.

    Values go through the parser exactly like typed flags (same types, choices and errors):
    `true` becomes `--flag` (`--no-flag` for false where the flag has one), lists become
    repeated values or JSON, mappings JSON.
    """
    path, rest = None, []
    it = iter(argv)
    for token in it:
        if token == "--config":
            path = next(it, None)
            if path is None:
                parser.error("argument --config: expected one argument")
        elif token.startswith("--config="):
            path = token.split("=", 1)[1]
        else:
            rest.append(token)
    if path is None:
        return argv
    return config_file_args(parser, path) + rest


def config_file_args(parser: argparse.ArgumentParser, path: str) -> list[str]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of option: value")
    actions = {s: a for a in parser._actions for s in a.option_strings}
    args: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None:
            parser.error(f"--config {path}: unknown option {key!r}")
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                args.append(flag)
            elif f"--no-{flag[2:]}" in actions:
                args.append(f"--no-{flag[2:]}")
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            # an item that is a mapping or list (a --lora-modules object) goes as JSON
            items = [json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value]
            if isinstance(action, argparse._ExtendAction):  # one `--flag=item` each: a
                args += [f"{flag}={v}" for v in items]      # positional after it stays one
            else:
                args += [flag, *items]
        elif isinstance(value, (list, dict)):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def add_media_args(parser: argparse.ArgumentParser) -> None:
    """Where chat image parts may come from (data: URLs always), as `vllm serve`."""
    g = parser.add_argument_group("images")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="Let image_url parts name file:// paths under this folder (refused "
                        "otherwise).")
    g.add_argument("--allowed-media-domains", nargs="+", default=[],
                   help="Let image_url parts be fetched over http(s) from these host names "
                        "(no network fetch otherwise).")


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    path = getattr(args, "allowed_local_media_path", None)
    if path is not None and not os.path.isdir(path):
        raise ValueError(f"--allowed-local-media-path {path!r} is not a folder")
    return MediaPolicy(path, tuple(d.lower() for d in getattr(args, "allowed_media_domains", [])))


def check_tool_call_parser(plugin: str, name: Optional[str]) -> None:
    """Loads a --tool-parser-plugin file (its parsers join the registry, in this process, which
    serves the requests), then checks --tool-call-parser against the registry (argparse cannot:
    a plugin adds names). A ValueError names the flag."""
    from jaxllm.entrypoints.openai_parsers.tool_parsers import TOOL_PARSERS, ToolParserManager
    if plugin:
        try:
            ToolParserManager.import_tool_parser(plugin)
        except ValueError as e:
            raise ValueError(f"--tool-parser-plugin {plugin!r}: {e}") from None
    if name is not None and name not in TOOL_PARSERS:
        hint = "" if plugin else " (or register one with --tool-parser-plugin)"
        raise ValueError(f"--tool-call-parser {name!r}: unknown; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}{hint}")
