"""The vLLM connector tests need vLLM 0.33, which pins its own torch: they run in the vLLM test venv
(``scripts/vllm-env.sh``, run by ``scripts/test.sh``) and are not collected in a venv without vLLM."""

import importlib.util

import pytest

collect_ignore_glob = (
    [] if importlib.util.find_spec("vllm") is not None else ["test_vllm_*.py", "test_multihost.py", "test_gpu_e2e.py"]
)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny model configs (kimi, gqa, mla) every connector test builds its engines from."""
    from vllm_harness import write_model_dirs

    return write_model_dirs(tmp_path_factory.mktemp("models"))
