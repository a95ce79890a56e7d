"""Run configuration (imports without torch). See :mod:`shipyard.config.schema`."""

from shipyard.config.load import ConfigError, load_config, to_toml
from shipyard.config.schema import ShipyardConfig

__all__ = ["ConfigError", "ShipyardConfig", "load_config", "to_toml"]
