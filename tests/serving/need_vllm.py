"""One rule for every test module of tests/serving: skipped where vLLM is not installed (the package's own venv),
a failure under ``make test-vllm`` (HF_POLYATTN_REQUIRE_VLLM=1), where a missing vLLM must not pass as a skip."""

import os

import pytest


def require_vllm() -> None:
    """Call at module level, before anything imports vLLM."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("HF_POLYATTN_REQUIRE_VLLM") == "1":
            raise
        pytest.skip("vLLM is not installed here (make test-vllm runs these tests in its own venv)",
                    allow_module_level=True)
