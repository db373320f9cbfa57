"""Our keys partition exactly as the Java client's default partitioner would place them.

The check runs Kafka's own ``Utils.murmur2`` (from the fetched kafka-clients jar) on the same keys,
so a Java service and a Python service agree on where a rollout lives.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rollbus.kafka.bus import Publisher
from rollbus.kafka.replay import key_partition
from rollbus.kafka.runtime import fetch
from tests.conftest import TEST_PARTITIONS
from tests.event_samples import SAMPLES

pytestmark = pytest.mark.kafka

JAVA_PARTITIONER = """
import java.nio.charset.StandardCharsets;
import org.apache.kafka.common.utils.Utils;

public class Partition {
    public static void main(String[] args) {
        int partitions = Integer.parseInt(args[0]);
        for (int i = 1; i < args.length; i++) {
            byte[] key = args[i].getBytes(StandardCharsets.UTF_8);
            System.out.println(Utils.toPositive(Utils.murmur2(key)) % partitions);
        }
    }
}
"""

KEYS = ["r-1", "rollout-42", "policy", "ü-ünïcode-✓", "a" * 300, "0", "r-20260131-000017"]


def java_partitions(partitions: int, keys: list[str], workdir: Path) -> list[int]:
    source = workdir / "Partition.java"
    source.write_text(JAVA_PARTITIONER)
    done = subprocess.run(
        ["java", "-cp", f"{fetch()}/*", str(source), str(partitions), *keys],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [int(line) for line in done.stdout.split()]


@pytest.mark.skipif(shutil.which("java") is None, reason="needs java to run Kafka's own partitioner")
async def test_rollout_keys_land_where_the_java_partitioner_puts_them(
    kafka_bootstrap: str, topics: dict, tmp_path: Path
) -> None:
    async with Publisher(kafka_bootstrap) as bus:
        ours = [
            (await bus.publish(topics["turns"], {**SAMPLES["turn"], "rollout_id": k})).partition for k in KEYS
        ]
    java = java_partitions(TEST_PARTITIONS, KEYS, tmp_path)
    assert ours == java
    assert [key_partition(k.encode(), TEST_PARTITIONS) for k in KEYS] == java  # replay --key reads only this
    assert len(set(ours)) > 1  # the keys do spread: the comparison is not trivially all-zero
