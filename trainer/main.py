"""``rollbus trainer``: consume ``segments``, train the policy, publish each new version to ``policy``.

Single process: ``rollbus trainer --group-size 4 --rollout-batch-size 2``. Sharded on one or more machines:
``torchrun --nproc-per-node 2 -m rollbus.trainer ...`` (FSDP2; NCCL between GPUs, gloo between CPU processes):
rank 0 consumes and commits, every rank trains a share of each batch on its shard of the model.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from rollbus.kafka.topics import TopicsError, check_topics
from rollbus.trainer.refill import RefillError, load_refills
from rollbus.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from rollbus.trainer.service import Trainer

add_arguments = TrainerSettings.add_arguments


def run(args: argparse.Namespace) -> int:
    settings = TrainerSettings.from_args(args)
    try:  # refuse missing/mismatched topics before the minutes torch and the model take to load
        asyncio.run(check_topics(settings.bootstrap_servers, settings.namespace))
    except TopicsError as exc:
        print(f"rollbus trainer: {exc}", file=sys.stderr)
        return 1
    try:  # a refill dataset that cannot be read is refused before the model loads too
        load_refills(settings.refill_dataset, 1, settings.refill_max_depth)
    except RefillError as exc:
        print(f"rollbus trainer: {exc}", file=sys.stderr)
        return 1
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
        return asyncio.run(serve(Trainer(learner)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


async def serve(trainer: Trainer) -> int:
    """Run until ``--steps`` are done or SIGINT/SIGTERM; a stop loses nothing uncommitted."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await trainer.run(stop)
