"""The ``--kv-plugin on`` bundle the plugin tests share (a build with the engine and the kernel's PTX: ~30 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def plugin_bundle(tmp_path_factory, tiny_llama):
    from edgec.build import build
    from tests.conftest import build_settings

    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx builds the engines (pip install 'edgec[tensorrt-rtx]')")
    pytest.importorskip("triton", reason="the plugin's kernel is compiled by Triton (edgec[dev])")
    out = tmp_path_factory.mktemp("rtx-plugin") / "tiny.rtx3060.plugin.edgec"
    kv = dict(kv_capacity=40, kv_window=8, kv_dtype="int8", kv_group=16)
    build(tiny_llama, out, build_settings(target="rtx3060", context=128, prefill_chunk=16, kv_plugin=True, **kv))
    return out
