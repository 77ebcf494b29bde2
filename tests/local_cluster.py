"""A real multi-node Ray cluster on 127.0.0.1, kept alive in its own process (tests/test_cluster.py), in one of two
layouts:

- ``two-node``: the head is the "CPU node" (resource ``cpu_node``, label ``node-type=cpu``); the second raylet
  stands in for a GPU node (resource ``gpu_node``, label ``node-type=gpu``). Each has one ``trial_slot``, so a
  Tune sweep whose workers take one runs a trial on each node; the GPU node has one ``elastic_slot``, and a third
  node with another joins on the line ``add`` and leaves on ``remove`` (each answered with a JSON line).
- ``preprocessing``: a head for training (label ``node-type=train``) and two CPU-only preprocessing nodes (label
  ``node-type=cpu``), each node with an object store of 100 MB. On ``lose``, the second preprocessing node is
  removed (a spot node reclaimed); on ``add``, another joins.

Prints one JSON line (GCS address, dashboard URL, node ids), then serves until its stdin closes or SIGTERM, and
shuts down.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every raylet on loopback
# Its own temp dir: Cluster writes its address to $RAY_TMPDIR/ray/ray_current_cluster, where Ray 2.60's state
# API looks for "the" cluster when asked without an address. In /tmp/ray it would send the Ray Train
# placement-group cleaners of another cluster on this machine (tests/servers.py's head) to this cluster's
# dashboard, which does not know their controllers: judged dead, their live runs' placement groups removed.
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: socket paths have a length limit

from ray.cluster_utils import Cluster


def main(layout: str, dashboard_port: int) -> None:
    dashboard = {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port}
    if layout == "two-node":
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "resources": {"cpu_node": 4, "trial_slot": 1},
                "labels": {"node-type": "cpu"},
                "object_store_memory": 300 * 2**20,
                **dashboard,
            },
        )
        gpu = cluster.add_node(
            num_cpus=2,
            resources={"gpu_node": 2, "trial_slot": 1, "elastic_slot": 1},
            labels={"node-type": "gpu"},
            object_store_memory=300 * 2**20,
        )
        nodes = {"cpu_node": cluster.head_node.node_id, "gpu_node": gpu.node_id}
    else:
        store = 100 * 2**20
        head = {"num_cpus": 2, "labels": {"node-type": "train"}, "object_store_memory": store, **dashboard}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        nodes = {"train_node": cluster.head_node.node_id}
        preprocessing = []
        for i in range(2):
            preprocessing.append(cluster.add_node(num_cpus=2, labels={"node-type": "cpu"}, object_store_memory=store))
            nodes[f"cpu_node_{i}"] = preprocessing[-1].node_id
    cluster.wait_for_nodes()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # killed, still shut the cluster down
    print(
        json.dumps({"address": cluster.address, "dashboard": f"http://127.0.0.1:{dashboard_port}", **nodes}),
        flush=True,
    )
    joined = []
    try:
        for line in sys.stdin:  # until the test closes it: "add" a third node, "remove" it (elastic training)
            if line.strip() == "add" and layout == "two-node":
                joined.append(cluster.add_node(num_cpus=1, resources={"elastic_slot": 1}))
                cluster.wait_for_nodes()
                print(json.dumps({"added": joined[-1].node_id}), flush=True)
            elif line.strip() == "add":
                joined.append(cluster.add_node(num_cpus=2, labels={"node-type": "cpu"}, object_store_memory=store))
                cluster.wait_for_nodes()
                print(json.dumps({"added": joined[-1].node_id}), flush=True)
            elif line.strip() == "remove":
                cluster.remove_node(joined.pop())
                print(json.dumps({"removed": True}), flush=True)
            elif line.strip() == "lose":
                lost = preprocessing.pop()
                cluster.remove_node(lost)
                print(json.dumps({"removed": lost.node_id}), flush=True)
    finally:
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
