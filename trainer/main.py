"""``rollbus trainer``: consume ``segments``, train the policy, publish each new version to ``policy``.

Single process: ``rollbus trainer --group-size 4 --rollout-batch-size 2``. Sharded on one or more machines:
``torchrun --nproc-per-node 2 -m rollbus.trainer ...`` (FSDP2; NCCL between GPUs, gloo between CPU processes):
rank 0 consumes and commits, every rank trains a share of each batch on its shard of the model.
"""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta

from rollbus.serve import check_topics_now, one_line_errors, run_service
from rollbus.trainer.refill import RefillError, load_refills
from rollbus.trainer.settings import TrainerSettings

add_arguments = TrainerSettings.add_arguments


def run(args: argparse.Namespace) -> int:
    settings = TrainerSettings.from_args(args)
    # refuse missing/mismatched topics, and a refill dataset that cannot be read, before the minutes torch
    # and the model take to load: one line, exit 1
    with one_line_errors("trainer", RefillError, bus=settings):
        check_topics_now(settings)
        load_refills(settings.refill_dataset, 1, settings.refill_max_depth)
    # torch and transformers load here, not at import: `rollbus trainer --help` stays fast
    import torch
    import torch.distributed as dist
    import transformers

    from rollbus.trainer.device import placement
    from rollbus.trainer.learner import Learner, follow
    from rollbus.trainer.service import Trainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(settings.threads or os.cpu_count() or 1)
    where = placement(settings.device, settings.precision)
    if where.device.type == "cuda":
        torch.cuda.set_device(where.device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(where.backend, timeout=timedelta(seconds=settings.dist_timeout))
    try:
        learner = Learner.resume(settings)
        if dist.is_initialized() and dist.get_rank() != 0:
            return follow(learner)
        # until --steps are done or SIGINT/SIGTERM; a stop loses nothing uncommitted
        return run_service("trainer", Trainer(learner).run, bus=None)  # topics checked above
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
