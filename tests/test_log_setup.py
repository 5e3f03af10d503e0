"""What a user sees on stderr: jaxllm's own log lines at the chosen --log-level, other
libraries' only when they warn (their info lines at debug), and not transformers' notice that
torch is missing (jaxllm never asks transformers for a model)."""

import logging

import pytest

import jaxllm  # noqa: F401  (installs the transformers filter)
from serving.log_setup import setup_logging


@pytest.fixture
def root_capture():
    """Records what reaches the root logger's handlers, levels restored after."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    root, ours, jax_logger = (logging.getLogger(), logging.getLogger("jaxllm"),
                              logging.getLogger("jax._src.xla_bridge"))
    saved = root.level, ours.level, jax_logger.level
    handler = Keep()
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)
    root.setLevel(saved[0])
    ours.setLevel(saved[1])
    jax_logger.setLevel(saved[2])


@pytest.mark.parametrize("level,ours,theirs", [
    ("info", {"INFO", "WARNING"}, {"WARNING"}),
    ("debug", {"DEBUG", "INFO", "WARNING"}, {"INFO", "WARNING"}),
    ("warning", {"WARNING"}, {"WARNING"})])
def test_log_levels(root_capture, level, ours, theirs):
    setup_logging(level)
    for name in ("jaxllm.engine", "jax._src.xla_bridge"):
        log = logging.getLogger(name)
        log.debug("d")
        log.info("i")
        log.warning("w")
    got = {(r.name, r.levelname) for r in root_capture}
    assert got == ({("jaxllm.engine", lv) for lv in ours}
                   | {("jax._src.xla_bridge", lv) for lv in theirs})


def test_transformers_torch_notice_is_dropped_and_its_other_lines_pass():
    """On the logger transformers logs it with (it keeps its records from the root's)."""
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    log = logging.getLogger("transformers")
    handler = Keep()
    log.addHandler(handler)
    try:
        log.warning("PyTorch was not found. Models won't be available and only tokenizers, "
                    "configuration and file/data utilities can be used.")
        log.warning("something else")
    finally:
        log.removeHandler(handler)
    assert messages == ["something else"]
