#!/usr/bin/python3
"""Two hosts behind a slow link: ddp, fsdp-full and hsdp on one model, 2 hosts x 2 ranks.

Two network namespaces joined by a veth pair, each end shaped by `tc qdisc ... tbf rate RATE`; one
`gradsync launch --nnodes 2 -n 2` in each. For every strategy, interleaved over --rounds, two runs (--short and
--long steps) give:
  step time   the median of the long runs' per-step seconds (JSONL "seconds"), the first 2 steps left out;
  bytes       bytes across hosts per step: the veth's transmitted bytes (both ends, IP and TCP headers
              included) of the long run minus the short run, over the steps between them, so that start-up
              (rendezvous, rank 0's broadcast) and the end's gathers cancel.
Prints a Markdown table with the predicted bytes per step across hosts (N = 4 ranks, ranks 0, 1 on one host and
2, 3 on the other, R = 2, S = 2, Psi the parameters' bytes; one micro-step per step):
  ddp        Gloo's ring all-reduce of Psi, 2 of its 4 links across, each carrying 2 Psi (N-1)/N: 3 Psi
  fsdp-full  two ring all-gathers (forward, backward), 2 links across each carrying Psi (N-1)/N: 3 Psi; the
             reduce-scatter (an all-to-all on Gloo) sends each rank Psi/N from every other, half of them across:
             2 Psi; together 5 Psi of the 9 Psi (4 ranks x 3 Psi (N-1)/N) the ranks send
  hsdp       only the shards' all-reduce between replicas crosses: 4 ranks x 2 (Psi/S)(R-1)/R = 2 Psi

Needs root, iproute2 and tc (Debian's iproute2); exits 77 saying why when they are missing.
Usage: bench/two_hosts_tbf.py [--gradsync build/gradsync] [--rate 100mbit] [--rounds 3] [--short 10] [--long 30]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

MODEL = "mlp:512-512-512-384-10"  # 726,154 parameters, four Linear layers: a unit each under --wrap children
STRATEGIES = {"ddp": [], "fsdp-full": ["--wrap", "children"], "hsdp": ["--wrap", "children"]}
PREDICTED_PSI = {"ddp": 3.0, "fsdp-full": 5.0, "hsdp": 2.0}


def sh(command, check=True):
    return subprocess.run(command, shell=True, check=check, capture_output=True, text=True)


class Hosts:
    def __init__(self, rate):
        self.id = os.getpid() % 200 + 20
        self.a, self.b = f"gb{self.id}a", f"gb{self.id}b"
        sh(f"ip netns add {self.a}; ip netns add {self.b}; ip link add {self.a} type veth peer name {self.b}; "
           f"ip link set {self.a} netns {self.a}; ip link set {self.b} netns {self.b}; "
           f"ip -n {self.a} addr add 10.78.{self.id}.1/24 dev {self.a}; "
           f"ip -n {self.b} addr add 10.78.{self.id}.2/24 dev {self.b}; "
           f"ip -n {self.a} link set {self.a} up; ip -n {self.b} link set {self.b} up; "
           f"ip -n {self.a} link set lo up; ip -n {self.b} link set lo up")
        for end in (self.a, self.b):  # burst: a few ms at the rate; latency bounds the queue
            sh(f"ip netns exec {end} tc qdisc add dev {end} root tbf rate {rate} burst 64kb latency 200ms")

    def close(self):
        sh(f"ip netns del {self.a}; ip netns del {self.b}", check=False)

    def tx_bytes(self):
        return sum(int(sh(f"ip netns exec {end} cat /sys/class/net/{end}/statistics/tx_bytes").stdout)
                   for end in (self.a, self.b))

    def run(self, gradsync, port, steps, strategy, log):
        procs = []
        for node, end in ((0, self.a), (1, self.b)):
            argv = ["ip", "netns", "exec", end, gradsync, "launch", "--nnodes", "2", "--node-rank", str(node),
                    "-n", "2", "--master-addr", f"10.78.{self.id}.1", "--master-port", str(port), "--",
                    gradsync, "train", "--model", MODEL, "--data", "synthetic:4096", "--global-batch", "32",
                    "--steps", str(steps), "--strategy", strategy, "--timeout", "120", "--quiet",
                    "--log", log if node == 0 else log + ".node1"] + STRATEGIES[strategy]
            env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=end, GRADSYNC_STORE_TOKEN="be9c4")
            for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GRADSYNC_BACKEND"):
                env.pop(key, None)
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            out, err = p.communicate(timeout=900)
            if p.returncode != 0:
                sys.exit(f"two_hosts_tbf: {strategy} failed ({p.returncode}):\n{out}\n{err}")
        with open(log) as f:
            return [json.loads(line)["seconds"] for line in f if line.strip()]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gradsync", default=os.path.join(os.path.dirname(__file__), "..", "build", "gradsync"))
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--short", type=int, default=10)
    p.add_argument("--long", type=int, default=30)
    args = p.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("two_hosts_tbf: skipped: needs root, ip and tc (iproute2)")
        return 77
    gradsync = os.path.abspath(args.gradsync)
    hosts = Hosts(args.rate)
    times = {s: [] for s in STRATEGIES}
    sent = {s: [] for s in STRATEGIES}
    port = 31000 + os.getpid() % 1000
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                for strategy in STRATEGIES:  # interleaved: drift of the machine spreads over every strategy
                    before = hosts.tx_bytes()
                    hosts.run(gradsync, port, args.short, strategy, f"{tmp}/s.jsonl")
                    short_bytes = hosts.tx_bytes() - before
                    before = hosts.tx_bytes()
                    seconds = hosts.run(gradsync, port + 1, args.long, strategy, f"{tmp}/l.jsonl")
                    long_bytes = hosts.tx_bytes() - before
                    port += 2
                    times[strategy] += seconds[2:]
                    sent[strategy].append((long_bytes - short_bytes) / (args.long - args.short))
                    print(f"round {rnd + 1} {strategy}: median step {statistics.median(seconds[2:]):.3f} s, "
                          f"{sent[strategy][-1] / 1e6:.2f} MB across hosts per step", file=sys.stderr)
    finally:
        hosts.close()
    psi = 4 * 726154
    fsdp = statistics.median(times["fsdp-full"])
    print(f"| strategy | median step (s) | x fsdp-full | MB across hosts per step | predicted (Psi = {psi / 1e6:.2f} MB) |")
    print("|---|---|---|---|---|")
    for s in STRATEGIES:
        t = statistics.median(times[s])
        print(f"| {s} | {t:.3f} | {t / fsdp:.2f} | {statistics.median(sent[s]) / 1e6:.2f} | "
              f"{PREDICTED_PSI[s]} Psi = {PREDICTED_PSI[s] * psi / 1e6:.2f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
