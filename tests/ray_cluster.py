"""Stopping a test's Ray cluster (shared by the Ray runtime tests)."""

import ray


def shutdown_cluster(cluster) -> None:
    """Disconnect this driver and stop `cluster`, whatever a straggling thread did."""
    ray.shutdown()
    try:
        cluster.shutdown()
    except ValueError:  # a straggling thread reconnected this driver: disconnect it again, then stop
        ray.shutdown()
        cluster.shutdown()
