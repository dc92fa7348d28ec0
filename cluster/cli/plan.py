"""``kvray plan``: the KV-cache plan a model would get (groups, pages, strides per layout,
what fits), from its config alone: no weights are read and no GPU is needed."""

from __future__ import annotations

from cluster.cli.flags import add_setting_flags, engine_config
from workers.model_source import model_config_for


def add_parser(commands, common) -> None:
    plan = commands.add_parser(
        "plan", parents=[common], help="print the KV-cache plan without loading weights"
    )
    add_setting_flags(plan)
    plan.add_argument(
        "--layouts",
        default="all",
        help="comma-separated layouts to show strides for (default: all six)",
    )


def run(args) -> int:
    from cluster.plan_report import plan_report

    config = engine_config(args)
    model_config = model_config_for(config.model)
    if config.pipeline_parallel_size != 1:
        from cluster.stage_plan_report import stage_plan_report

        print(stage_plan_report(config, model_config))
        return 0
    layouts = None if args.layouts == "all" else args.layouts.split(",")
    print(plan_report(config, model_config, layouts))
    return 0
