"""`bench/serving/bench_vs_vllm.py` freezes the servers it is not measuring: every process of a server's tree
stops (SIGSTOP) for another's turn and runs again after it."""

import signal
import subprocess
import time

from bench.serving import bench_vs_vllm


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_servers_whole_tree_is_stopped_and_runs_again():
    server = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(tree := bench_vs_vllm.process_tree(server.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(tree) == 3 and tree[0] == server.pid  # the shell and its two sleeps
        bench_vs_vllm.signal_all(tree, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while any(state(pid) != "T" for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(state(pid) == "T" for pid in tree)
        bench_vs_vllm.signal_all(tree + [2 ** 22 + 1], signal.SIGCONT)  # one gone meanwhile is no error
        deadline = time.monotonic() + 5
        while any(state(pid) == "T" for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(state(pid) == "T" for pid in tree)
    finally:
        for pid in bench_vs_vllm.process_tree(server.pid)[::-1]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        server.wait()
