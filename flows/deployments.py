"""Scheduled retraining: the `retrain` flow as a Prefect deployment on a cron schedule.

    python -m flows.deployments --serve                   # register and run the schedule in this process
    python -m flows.deployments --cron "0 3 * * 1" --serve

Scheduled runs only execute while something polls for them: this process (``--serve``) or a
worker of a work pool. A deployment with neither shows its runs as *Late* in the UI forever;
``--serve`` says so on start-up. Point ``PREFECT_API_URL`` at a Prefect server
(``./run services start prefect``) so runs and schedules survive restarts.
"""

from __future__ import annotations

import argparse

from prefect import serve
from prefect.schedules import Cron

from flows._common import DEFAULT_CONFIG
from flows.retrain import retrain

DEFAULT_CRON = "0 3 * * 1"  # Mondays 03:00
DEPLOYMENT_NAME = "scheduled-retrain"


def retrain_deployment(cron: str = DEFAULT_CRON, config: str = DEFAULT_CONFIG, timezone: str = "UTC"):
    """The deployment object (not yet applied or served), so it can be inspected and tested."""

    return retrain.to_deployment(
        name=DEPLOYMENT_NAME,
        schedule=Cron(cron, timezone=timezone),
        parameters={"config": config, "replay_traffic": False},
        description="Curate, train, evaluate, gate and deploy the document-markup model.",
        tags=["docmarkup", "retraining"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--timezone", default="UTC")
    parser.add_argument("--serve", action="store_true", help="run the schedule in this process (blocks)")
    args = parser.parse_args(argv)
    deployment = retrain_deployment(args.cron, args.config, args.timezone)
    if args.serve:
        print(f"serving '{DEPLOYMENT_NAME}' on cron '{args.cron}' ({args.timezone}); scheduled runs execute only "
              "while this process runs — stop it and they will show as Late.")
        serve(deployment)
    else:
        deployment_id = deployment.apply()
        print(f"deployment '{DEPLOYMENT_NAME}' registered ({deployment_id}) with cron '{args.cron}'. "
              "Nothing runs it until `python -m flows.deployments --serve` (or a worker) is running.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
