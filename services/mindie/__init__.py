"""A MindIE Service ``config.json`` (MindIE 1.0.RC3 to 2.x: ServerConfig, BackendConfig with ModelDeployConfig and
ScheduleConfig, LogConfig) read as is by ``sluice serve --config``: every key, nested ones included, is mapped to
its Sluice effect, accepted with one log line saying why it has none, or refused with the reason. Flags given on
the command line override what the file sets. The table of keys: docs/serving.md#a-mindie-configjson."""

from services.mindie.config import ConfigFileError, MindieConfig, load_mindie_config, read_mindie_config
from services.mindie.outcome import KeyResult, Treatment

__all__ = ["ConfigFileError", "KeyResult", "MindieConfig", "Treatment", "load_mindie_config", "read_mindie_config"]
