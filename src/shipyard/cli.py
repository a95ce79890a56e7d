"""The `shipyard` command: `train`, `eval`, `serve`, `relay`, `warmstart`, `midtrain`, `trainer`, `worker`,
`region`, `health`, `online ACTION`, each taking a TOML config and dotted overrides, and `view`, taking run directories.

Thin by design: parse arguments and the config (no torch import), print it on `--dry-run`, then
import the heavy subsystem. A wrong field or value exits with status 2 and a message naming it.

    shipyard train configs/demo.toml trainer.lr=2e-5 run.name=try2
    shipyard eval configs/demo.toml eval.version=20 eval.label=demo
    shipyard serve configs/demo.toml inference.port=8000
    shipyard relay configs/demo.toml relay.mirror.root=/data/region-eu
    shipyard warmstart configs/long_horizon.toml warmstart.output_dir=runs/long-sft
    shipyard midtrain configs/midtrain.toml trainer.world_size=2   # then model.init_from=runs/midtrain/final
    shipyard trainer configs/demo.toml                  # the trainer alone (resumes its checkpoint)
    shipyard worker configs/demo.toml --server http://127.0.0.1:8000 --worker-id w0
    shipyard region configs/demo.toml fleet.region=eu  # a [[fleet.regions]] entry: relay, servers, workers
    shipyard health configs/demo.toml --for 90          # exit 3 if a standalone component stalled
    shipyard train configs/demo.toml --dry-run
    shipyard view runs/demo runs/try2 --port 8600       # dashboard and rollout viewer in a browser
    shipyard online gateway configs/demo.toml online.gateway.upstream=http://127.0.0.1:8000
    shipyard online status configs/demo.toml            # also: mature, export --out FILE, retain
    shipyard online rollback 3 configs/demo.toml        # or --version 3; promote CANDIDATE likewise
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from shipyard.config import ConfigError, load_config, to_toml
from shipyard.config.schema import ShipyardConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shipyard", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("train", "run asynchronous RL (trainer, inference servers, rollout workers)"),
        ("eval", "pass@1 of a weight version on HumanEval and held-out tasks"),
        ("serve", "serve the policy over HTTP, following new weight versions"),
        ("relay", "mirror weight versions from the origin store into a region's store"),
        ("warmstart", "fine-tune the policy on demonstrations before RL (long tasks)"),
        ("midtrain", "next-token training on this machine's Python code before RL (model.init_from)"),
        ("trainer", "run the trainer of a run alone, as its own process (resumes from its checkpoint)"),
        ("worker", "run one rollout worker of a run alone, against an inference server"),
        (
            "region",
            "run a region of fleet.regions on this machine: its relay, servers and workers, supervised",
        ),
        ("health", "watch a run's components from outside (a supervisor's probe); exit 3 if one stalled"),
    ]:
        s = sub.add_parser(name, help=help_text)
        s.add_argument("config", help="TOML config file (see configs/)")
        s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
        s.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        if name == "worker":
            s.add_argument("--server", required=True, help="inference server URL, e.g. http://127.0.0.1:8000")
            s.add_argument("--worker-id", default="w0", help="names the worker's batches (rollouts/<id>/)")
        if name == "health":
            s.add_argument(
                "--server", action="append", default=[], help="an inference server URL to probe too"
            )
            s.add_argument(
                "--for", dest="for_s", type=float, help="watch this many seconds (default: until Ctrl-C)"
            )
    o = sub.add_parser("online", help="real-time RL from served traffic: gateway, rewards, export, retention")
    o.add_argument(
        "action", choices=["gateway", "mature", "export", "retain", "status", "promote", "rollback"]
    )
    o.add_argument("config", help="TOML config file (see configs/)")
    o.add_argument(
        "--version", type=int, help="the version `promote` (a candidate) or `rollback` (a serving one) names"
    )
    o.add_argument("overrides", nargs="*", help="dotted overrides, e.g. online.db.dsn=postgresql://...")
    o.add_argument("--out", help="output file of `export` (JSONL)")
    o.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    v = sub.add_parser(
        "view", help="dashboard and rollout viewer of runs, in a browser (live while they run)"
    )
    v.add_argument(
        "run_dirs", nargs="+", help="run directories (<run.output_dir>/<run.name>, e.g. runs/demo)"
    )
    v.add_argument("--host", default="127.0.0.1", help="interface to listen on (loopback by default)")
    v.add_argument("--port", type=int, default=8600, help="port to listen on")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "view":
        return _view(args)
    if args.command == "online" and not _version_first(args):
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"shipyard: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(to_toml(cfg))
        return 0
    if args.command == "train":
        _stop_on_signals()  # SIGTERM from a supervisor: stop the placement (a Ray driver's actors) first
        _train(cfg)
    elif args.command == "eval":
        from shipyard.eval.command import run_eval

        run_eval(cfg)
    elif args.command == "warmstart":
        _warmstart(cfg)
    elif args.command == "midtrain":
        _midtrain(cfg)
    elif args.command == "trainer":
        from shipyard.orchestrate.standalone import trainer_process

        _stop_on_signals()
        print(trainer_process(cfg))
    elif args.command == "worker":
        from shipyard.orchestrate.standalone import worker_process

        _stop_on_signals()
        print(f"worker {args.worker_id}: {worker_process(cfg, args.worker_id, args.server)} batches")
    elif args.command == "region":
        return _region(cfg, args)
    elif args.command == "online":
        return _online(cfg, args)
    elif args.command == "health":
        from shipyard.orchestrate.standalone import STALL_EXIT
        from shipyard.orchestrate.supervise import watch_run

        return STALL_EXIT if watch_run(cfg, args.server, args.for_s) else 0
    elif args.command == "relay":
        from shipyard.orchestrate.standalone import relay_process

        _stop_on_signals()
        relay_process(cfg)
    else:
        from shipyard.inference.serving.serve import serve

        _stop_on_signals()
        serve(cfg)
    return 0


def _train(cfg: ShipyardConfig) -> None:
    """``shipyard train``; a stall the watchdog named ends the process at once (exit code 3), as the
    stalled thread cannot be stopped and would keep it alive: a supervisor restarts it, and the
    restarted run resumes from its last checkpoint."""
    from shipyard.metrics.health import StallError
    from shipyard.orchestrate.standalone import STALL_EXIT
    from shipyard.orchestrate.train import train

    try:
        train(cfg)
    except StallError as e:
        print(f"shipyard train: stopped: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(STALL_EXIT)


def _warmstart(cfg: ShipyardConfig) -> None:
    """``shipyard warmstart``: supervised fine-tuning on demonstrations, then where the policy is."""
    from shipyard.orchestrate.warmstart import run_warmstart

    report = run_warmstart(cfg)
    print(f"warm start: {report['demos_kept']} demonstrations, loss by epoch {report['epoch_loss']}")
    print(f"policy: {cfg.warmstart.output_dir} (use model.source=hf model.path=...)")


def _midtrain(cfg: ShipyardConfig) -> None:
    """``shipyard midtrain``: packed next-token training, then the held-out loss and the policy."""
    from shipyard.orchestrate.midtrain import run_midtrain

    report = run_midtrain(cfg)
    print(
        f"midtrain: held-out code loss {report['heldout_code_loss_before']:.4f} -> "
        f"{report['heldout_code_loss_after']:.4f} after {report['steps']} steps"
    )
    print(f"policy: {cfg.midtrain.output_dir}/final (RL starts from it with model.init_from=...)")


def _region(cfg: ShipyardConfig, args: argparse.Namespace) -> int:
    """``shipyard region``: run this machine's entry of ``fleet.regions`` until the run ends."""
    from shipyard.fleet.region import Region

    _stop_on_signals()
    try:
        region = Region(cfg, args.config, args.overrides)
    except ValueError as e:
        print(f"shipyard region: {e}", file=sys.stderr)
        return 2
    try:
        return region.run()
    except KeyboardInterrupt:  # stopped by a signal: run() stopped its processes on the way out
        return 0


def _version_first(args: argparse.Namespace) -> bool:
    """``shipyard online rollback 3 CONFIG ...``: the version may come before the config."""
    if args.config.isdigit():
        if not args.overrides:
            print(f"shipyard online {args.action}: give the config after the version", file=sys.stderr)
            return False
        args.version, args.config = int(args.config), args.overrides.pop(0)
    return True


def _online(cfg: ShipyardConfig, args: argparse.Namespace) -> int:
    import json

    from shipyard.online.command import run_online

    if args.action == "gateway":
        _stop_on_signals()
    try:
        print(json.dumps(run_online(cfg, args.action, args.out, args.version), indent=1, default=str))
    except ValueError as e:
        print(f"shipyard online: {e}", file=sys.stderr)
        return 2
    return 0


def _view(args: argparse.Namespace) -> int:
    from shipyard.view.server import serve_view

    _stop_on_signals()
    try:
        serve_view(args.run_dirs, args.host, args.port)
    except ValueError as e:
        print(f"shipyard view: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, after the server shut down
        pass
    return 0


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM stop a long-running command cleanly (``KeyboardInterrupt`` in the main thread).

    Set explicitly: a process started with SIGINT ignored (inherited from its parent, e.g. a
    supervisor or a test runner) would otherwise never see Ctrl-C, and SIGTERM would skip cleanup.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
