"""Harnesses: the programs that play sessions, behind one interface (:mod:`.base`).

Contract: :func:`make_harness` builds the harness ``harness.type`` names: ``builtin``
(:mod:`.builtin`, Shipyard's own agent, the default) or ``command`` (:mod:`.command`: any program,
confined to the session's sandbox, reaching the model only through its session endpoint,
:mod:`shipyard.agent.endpoint`; :mod:`.relay` is its side of the socket).

Example::

    spec = dataclasses.replace(session_spec(cfg, client, tok), harness=make_harness(cfg))
    segments = play(spec, task, "g0", 0, env)
"""

from __future__ import annotations

from shipyard.agent.harness.base import Harness
from shipyard.config.schema import ShipyardConfig


def make_harness(cfg: ShipyardConfig) -> Harness:
    """The harness of ``cfg.harness.type``."""
    if cfg.harness.type == "builtin":
        from shipyard.agent.harness.builtin import BuiltinHarness

        return BuiltinHarness()
    if cfg.harness.type == "command":
        from shipyard.agent.harness.command import CommandHarness

        return CommandHarness(cfg.harness, cfg.sandbox, cfg.agent.max_session_tokens)
    raise ValueError(f"harness.type={cfg.harness.type!r}; expected 'builtin' or 'command'")
