"""Shipyard: asynchronous, disaggregated RL for agentic coding models."""

__version__ = "0.1.0"
