"""`--tool-parser-plugin PATH`: a user's Python file that registers tool parsers, as vLLM's
`ToolParserManager.register_module` plugins do:

    from jaxllm.entrypoints.openai_parsers.tool_parsers import ToolParser, ToolParserManager
    from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan

    @ToolParserManager.register_module("my_format")
    class MyToolParser(ToolParser):
        def scan(self, text, final):   # see base.py: content so far and the complete calls
            ...

then `--tool-call-parser my_format`. A parser subclasses jaxllm's ToolParser (one `scan`
gives both the message and the stream); vLLM's parser classes, with their other interface,
do not load here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional, Union

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import ToolParser


class ToolParserManager:
    """The registry of tool parsers by name (the built-ins and what plugins add)."""
    parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: Union[str, list[str], None] = None, force: bool = True,
                        module: Optional[type] = None):
        """Registers `module` (or, used as a decorator, the class it decorates) under `name`
        (or names; default the class's `name`). A name already taken is refused unless
        `force`, which replaces it, as vLLM's."""
        def register(parser: type) -> type:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"tool parser {parser!r} must subclass jaxllm's ToolParser "
                                f"(jaxllm.entrypoints.openai_parsers.tool_parsers.ToolParser)")
            names = [name] if isinstance(name, str) else list(name or [])
            if not names:
                names = [getattr(parser, "name", None) or parser.__name__]
            for n in names:
                if n in cls.parsers and not force:
                    raise KeyError(f"tool parser {n!r} is already registered")
                cls.parsers[n] = parser
            if "name" not in parser.__dict__:
                parser.name = names[0]
            return parser

        return register(module) if module is not None else register

    @classmethod
    def import_tool_parser(cls, path: str) -> None:
        """Runs the plugin file at `path` (it registers its parsers); a ValueError says why a
        file does not load."""
        if not os.path.isfile(path):
            raise ValueError(f"no such file {path!r}")
        # a name of its own, so that a plugin file called json.py shadows nothing
        module_name = "jaxllm_tool_parser_plugin_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{path!r} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's code: any failure is a start-up error
            sys.modules.pop(module_name, None)
            raise ValueError(f"{path!r} failed to load: {type(e).__name__}: {e}") from e
