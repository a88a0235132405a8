"""``--kv-transfer-config`` as vLLM takes it: what Sluice reads, and every key, connector and combination it cannot
honour refused naming it (never read and then ignored)."""

from __future__ import annotations

import argparse
import json

import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig, KVOffloadConfig
from engine.entrypoints.args import add_engine_args, config_from_args
from engine.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from services.child_flags import engine_flags


def parse(value: object) -> KVTransferConfig:
    return parse_kv_transfer_config(value)


def test_vllms_json_is_read_with_its_defaults() -> None:
    config = parse('{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer"}')
    assert (config.transport, config.is_producer, config.is_consumer) == ("shm", True, False)
    assert (config.hold_timeout_s, config.transfer_timeout_s) == (60.0, 10.0)
    mooncake = parse({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_both", "kv_ip": "10.0.0.2",
                      "kv_port": 17000, "kv_connector_extra_config": {"hold_timeout_s": 30, "protocol": "tcp"}})
    assert (mooncake.transport, mooncake.kv_ip, mooncake.kv_port, mooncake.hold_timeout_s) == (
        "mooncake", "10.0.0.2", 17000, 30)
    assert mooncake.is_producer and mooncake.is_consumer
    assert parse(mooncake.to_json()) == mooncake   # what `sluice serve` hands its engines


@pytest.mark.parametrize(("value", "field", "words"), [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "kv_transfer_config.kv_connector", "NIXL"),
    ({"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer"}, "kv_transfer_config.kv_connector", "NCCL"),
    ({"kv_connector": "Nope", "kv_role": "kv_producer"}, "kv_transfer_config.kv_connector", "must be one of"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "prefill"}, "kv_transfer_config.kv_role", "kv_consumer"),
    ({"kv_connector": "SharedMemoryConnector"}, "kv_transfer_config.kv_role", "required"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer", "kv_rank": 0},
     "kv_transfer_config.kv_rank", "pairs engines by their role"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer", "kv_buffer_size": 1e9},
     "kv_transfer_config.kv_buffer_size", "no transfer buffer"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda"},
     "kv_transfer_config.kv_buffer_device", "host memory"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer", "kv_port": 5},
     "kv_transfer_config.kv_port", "MooncakeConnector"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer", "whatever": 1},
     "kv_transfer_config.whatever", "not a key"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"protocol": "tcp"}},
     "kv_transfer_config.kv_connector_extra_config.protocol", "not a key SharedMemoryConnector takes"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"protocol": "rdma"}},
     "kv_transfer_config.kv_connector_extra_config.protocol", "only Mooncake's tcp"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"hold_timeout_s": 5, "transfer_timeout_s": 5}},
     "kv_transfer_config.kv_connector_extra_config.transfer_timeout_s", "below hold_timeout_s"),
    ("[1]", "kv_transfer_config", "JSON object"),
    ("{", "kv_transfer_config", "not valid JSON"),
])
def test_what_cannot_be_honoured_is_refused_naming_it(value: object, field: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as e:
        parse(value)
    assert e.value.field == field


def config_of(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_the_flag_reaches_the_config_and_the_child_flags() -> None:
    flag = json.dumps({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_consumer"})
    config = config_of("--kv-transfer-config", flag, "--device", "cpu")
    assert config.kv_transfer_config == KVTransferConfig("SharedMemoryConnector", "kv_consumer")
    assert config_of(*engine_flags(config)).kv_transfer_config == config.kv_transfer_config
    with pytest.raises(InvalidRequestError) as e:
        config_of("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert e.value.field == "--kv-transfer-config.kv_connector"


@pytest.mark.parametrize(("changes", "field"), [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_offloading_config": KVOffloadConfig(size_gib=1.0)}, "kv_offloading_size"),
    ({"async_scheduling": True}, "async_scheduling"),
    ({"device": "npu"}, "device"),
])
def test_combinations_it_cannot_run_are_refused_at_start_up(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(kv_transfer_config=KVTransferConfig("SharedMemoryConnector", "kv_both"),
                     **{"device": "cpu", **changes})  # type: ignore[arg-type]
    assert e.value.field == field
