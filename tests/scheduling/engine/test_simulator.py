import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from scheduling.simulator.inflation import arrival_sequence, rounds_to, run_inflation
from scheduling.simulator.replay import percentile, run_replay
from scheduling.simulator.trace import TraceError, load_nodes, load_pods

ROOT = Path(__file__).resolve().parents[3]
TRACE = next(
    (p for p in (ROOT.parent / "shared/traces/openb", Path("/work/shared/traces/openb")) if p.is_dir()),
    ROOT.parent / "shared/traces/openb",
)
POD_COLS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"


@pytest.fixture
def tiny(tmp_path):
    # two nodes: one 1-GPU (A), one 2-GPU (B); capacity 3000 milli
    (tmp_path / "nodes.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn1,8000,8192,1,A\nn2,8000,8192,2,B\n"
    )
    rows = [
        "p1,1000,1024,1,500,,LS,Running,0,100,0",  # shares a GPU
        "p2,1000,1024,2,1000,,LS,Running,10,100,10",  # takes both GPUs of n2
        "p3,1000,1024,1,1000,B,LS,Running,20,100,20",  # only B: fails (n2 is full)
        "p4,1000,1024,1,500,,LS,Running,30,100,30",  # fills p1's GPU
    ]
    (tmp_path / "pods.csv").write_text(POD_COLS + "\n" + "\n".join(rows) + "\n")
    (tmp_path / "arrivals.txt").write_text("p1\np2\np3\np4\n")
    return tmp_path


def test_metric_on_a_hand_made_trace(tiny):
    nodes, catalog = load_nodes(tiny / "nodes.csv")
    pods = load_pods(tiny / "pods.csv")
    from scheduling.simulator.inflation import arrivals_from_file

    seq = arrivals_from_file(str(tiny / "arrivals.txt"), pods)
    res = run_inflation(nodes, catalog, pods, policy="bestfit", arrivals=seq, keep_rows=True)
    # requested after each arrival: 500, 2500, 3500, 4000 of 3000 -> 16.7 %, 83.3 %, 116.7 %, 133.3 %
    # allocated: 500, 2500, 2500, 3000 -> 16.7 %, 83.3 %, 83.3 %, 100 %
    assert res.capacity_gpu_milli == 3000
    assert res.failed == 1
    assert [r[5] for r in res.rows] == [500, 2500, 2500, 3000]
    assert res.rows[2][2] == "" and res.rows[1][2] == "n2" and res.rows[1][3] == 2
    # no arrival's requested % rounds to 50, 100 or 130
    assert res.allocation_ratio == {"50": None, "100": None, "130": None}


def test_allocation_ratio_is_the_mean_over_arrivals_rounding_to_x(tmp_path):
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,65536,10,A\n")
    # ten pods of 130 milli: requested goes 1.3 %, 2.6 %, ... ; capacity 10000
    rows = [f"p{i},100,100,1,650,,LS,Running,0,1,0" for i in range(30)]
    (tmp_path / "pods.csv").write_text(POD_COLS + "\n" + "\n".join(rows) + "\n")
    nodes, catalog = load_nodes(tmp_path / "nodes.csv")
    pods = load_pods(tmp_path / "pods.csv")
    res = run_inflation(nodes, catalog, pods, policy="gpupool", tune=1.3, seed=1, keep_rows=True)
    # 650-milli pods: requested k*6.5 %; allocated: one per GPU (10 fit), so min(k, 10) * 6.5 %
    req = [r[4] for r in res.rows]
    assert req[-1] >= 13000 and req[-2] < 13000
    # arrivals with requested % rounding to 50: none (6.5k % steps: 45.5, 52.0); to 130: k=20 (130.0 %)
    assert res.allocation_ratio["50"] is None
    assert res.allocation_ratio["130"] == pytest.approx(65.0)
    assert rounds_to(1295, 1000, 130) and not rounds_to(1305, 1000, 130) and rounds_to(995, 1000, 100)


def test_arrival_sequence_inflates_and_cuts():
    pods = load_pods(TRACE / "openb_pod_list_default.csv")
    seq = arrival_sequence(pods, 6_212_000, 1.3, 42)
    total = sum(p.gpu_request_milli for p in seq)
    assert total >= 1.3 * 6_212_000 > total - seq[-1].gpu_request_milli
    assert seq[: len(pods)] != pods and len({p.name for p in seq[: len(pods)]}) == len(pods)
    assert arrival_sequence(pods, 6_212_000, 1.3, 42) == seq
    cut = arrival_sequence(pods, 6_212_000, 0.5, 42)
    assert len(cut) < len(pods)


def test_bad_trace_is_reported(tmp_path):
    (tmp_path / "n.csv").write_text("sn,cpu_milli,gpu,model\nx,1,1,A\n")
    with pytest.raises(TraceError, match="memory_mib"):
        load_nodes(tmp_path / "n.csv")


def test_replay_queues_until_capacity_frees(tiny):
    nodes, catalog = load_nodes(tiny / "nodes.csv")
    pods = load_pods(tiny / "pods.csv")
    res = run_replay(nodes, catalog, pods, policy="gpupool")
    # p3 (B only, whole GPU) waits for p2 to leave at t=100 (created 20): delay 80
    assert res.placed == 4 and res.delay["p99"] == 80.0
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4


def test_simulate_command_on_a_slice_of_the_real_trace(tmp_path):
    lines = (TRACE / "openb_pod_list_default.csv").read_text().splitlines()
    (tmp_path / "pods.csv").write_text("\n".join(lines[:400]) + "\n")
    nodes = (TRACE / "openb_node_list_gpu_node.csv").read_text().splitlines()
    (tmp_path / "nodes.csv").write_text("\n".join(nodes[:80]) + "\n")
    out = StringIO()
    args = ["--nodes", str(tmp_path / "nodes.csv"), "--pods", str(tmp_path / "pods.csv")]
    call_command("simulate", "inflation", *args, "--json", "--log", str(tmp_path / "log.csv"), stdout=out)
    data = json.loads(out.getvalue())
    assert set(data) >= {"policy", "capacity_gpu_milli", "allocation_ratio", "failed", "decisions_per_s"}
    assert data["policy"] == "gpupool" and set(data["allocation_ratio"]) == {"50", "100", "130"}
    assert 40 < data["allocation_ratio"]["50"] <= 50.5
    log = (tmp_path / "log.csv").read_text().splitlines()
    assert log[0] == "seq,pod,node,gpus,requested_gpu_milli,allocated_gpu_milli" and len(log) > 100
    out = StringIO()
    png = tmp_path / "r.png"
    call_command("simulate", "replay", *args, "--policy", "bestfit", "--json", "--plot", str(png), stdout=out)
    data = json.loads(out.getvalue())
    assert data["placed"] + data["never_placed"] == 399
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_simulator_splits_pods_that_allow_it(tmp_path):
    # two 2-GPU nodes; a 4-GPU pod fits only as 2 + 2
    (tmp_path / "nodes.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn1,8000,8192,2,A\nn2,8000,8192,2,A\n"
    )
    cols = POD_COLS + ",gpus_per_node"
    rows = ["p1,1000,1024,4,1000,,LS,Running,0,100,0,", "p2,1000,1024,4,1000,,LS,Running,10,100,10,2|4"]
    (tmp_path / "pods.csv").write_text(cols + "\n" + "\n".join(rows) + "\n")
    (tmp_path / "arrivals.txt").write_text("p1\np2\n")
    nodes, catalog = load_nodes(tmp_path / "nodes.csv")
    pods = load_pods(tmp_path / "pods.csv")
    assert [p.gpus_per_node for p in pods] == [(), (2, 4)]
    from scheduling.simulator.inflation import arrivals_from_file

    res = run_inflation(
        nodes, catalog, pods, arrivals=arrivals_from_file(str(tmp_path / "arrivals.txt"), pods)
    )
    assert res.failed == 1  # p1 (one node only) never fits; p2 does, split
    # The replay holds all four GPUs for p2 and frees them at its end.
    res = run_replay(*load_nodes(tmp_path / "nodes.csv"), pods, policy="gpupool")
    assert res.placed == 1 and res.never_placed == 1 and res.utilisation_peak == pytest.approx(100.0)
    bad = tmp_path / "bad.csv"
    bad.write_text(cols + "\np3,1,1,4,1000,,LS,Running,0,1,0,2|x\n")
    with pytest.raises(TraceError):
        load_pods(bad)


def test_replay_orders_its_queue_by_the_queue_policy(tmp_path):
    # One GPU busy until t=100; a long job (1000 s) arrives at t=1, a short one (10 s) at t=2.
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,8000,8192,1,A\n")
    rows = [
        "p0,1000,1024,1,1000,,LS,Running,0,100,0",
        "long,1000,1024,1,1000,,LS,Running,1,1001,1",
        "short,1000,1024,1,1000,,LS,Running,2,12,2",
    ]
    (tmp_path / "pods.csv").write_text(POD_COLS + "\n" + "\n".join(rows) + "\n")
    nodes, catalog = load_nodes(tmp_path / "nodes.csv")
    pods = load_pods(tmp_path / "pods.csv")
    mean = {
        q: run_replay(nodes, catalog, pods, policy="gpupool", queue_policy=q).delay["mean"]
        for q in (None, "fcfs", "sjf", "priority_aging")
    }
    # FCFS: long waits 99 s, short 1098 s; SJF: short waits 98 s, long 109 s.
    assert mean["fcfs"] == pytest.approx((0 + 99 + 1098) / 3)
    assert mean["sjf"] == pytest.approx((0 + 98 + 109) / 3)
    assert mean[None] == mean["fcfs"] == mean["priority_aging"]
