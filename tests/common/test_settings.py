from __future__ import annotations

import pytest

from common.settings import ENV_PARENT_PID, api_key, kernel_switches, row_limit, switched_on, take_parent_pid
from engine.config import EngineConfig, KernelSettings


def test_switches_default_on_and_read_the_usual_offs() -> None:
    assert switched_on("SLUICE_X", {})
    for off in ("0", "false", " No ", "OFF"):
        assert not switched_on("SLUICE_X", {"SLUICE_X": off})
    for on in ("1", "yes", "true", ""):
        assert switched_on("SLUICE_X", {"SLUICE_X": on})


def test_row_limit_reads_non_negative_integers_only() -> None:
    assert row_limit("N", {}) is None and row_limit("N", {"N": "  "}) is None
    assert row_limit("N", {"N": " 16 "}) == 16 and row_limit("N", {"N": "0"}) == 0
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ValueError, match="N must be a non-negative integer"):
            row_limit("N", {"N": bad})


def test_kernel_settings_take_every_switch_from_the_environment_by_field_name() -> None:
    env = {"SLUICE_CPU_KERNELS": "0", "SLUICE_AMX_LINEAR": "off", "SLUICE_AMX_PREFILL": "no",
           "SLUICE_QUANT_MAX_ROWS": "4", "SLUICE_KV_HUGE_PAGES": "false", "SLUICE_MALLOC_TUNING": "0"}
    assert set(kernel_switches({})) == {f for f in KernelSettings.__dataclass_fields__}
    assert KernelSettings.from_env(env) == KernelSettings(cpu_kernels=False, amx_linear=False, amx_prefill=False,
                                                          quant_max_rows=4, kv_huge_pages=False,
                                                          malloc_tuning=False)
    assert KernelSettings.from_env({}) == KernelSettings()


def test_engine_config_reads_the_switches_once_and_a_caller_can_pass_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_AMX_LINEAR", "0")
    config = EngineConfig()
    assert not config.kernels.amx_linear
    monkeypatch.setenv("SLUICE_AMX_LINEAR", "1")
    assert not config.kernels.amx_linear  # frozen at construction, not re-read
    assert EngineConfig(kernels=KernelSettings(amx_linear=True)).kernels.amx_linear


def test_api_key_and_parent_pid() -> None:
    assert api_key({}) is None and api_key({"SLUICE_API_KEY": ""}) is None
    assert api_key({"SLUICE_API_KEY": "k"}) == "k"
    env = {ENV_PARENT_PID: "123", "OTHER": "x"}
    assert take_parent_pid(env) == 123 and env == {"OTHER": "x"}  # children's children do not inherit it
    assert take_parent_pid(env) is None
