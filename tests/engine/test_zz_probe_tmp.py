import pytest, torch
from pathlib import Path
import tests.engine.test_npu_moe_engine as t
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import npu_device_twin, torch_npu_twin  # noqa

@pytest.mark.usefixtures("npu_device_twin")
def test_probe(tmp_path, monkeypatch):
    _, path = t.write_checkpoint("deepseek_v3", tmp_path / "d")
    exp, _ = t._generate(t._core(path, "cpu"))
    print("cpu", exp)
    got, _ = t._generate(t._core(path, "npu"))
    print("npu", got)
    orig = twin._npu_paged_attention_mla.__wrapped__
    import tests.engine.npu_twin.mla as m
    def bad(**kw):
        kw["scale_value"] = kw["scale_value"] * 1.5
        return orig(**kw)
    import engine.attention.npu_mla as nm
    class Ops:
        def __getattr__(self, n): return bad if n == "_npu_paged_attention_mla" else getattr(twin, n)
    monkeypatch.setattr(nm.NpuLatentAttention, "__init__", lambda self, ops: setattr(self, "ops", Ops()))
    bad_got, _ = t._generate(t._core(path, "npu"))
    print("bad", bad_got)
