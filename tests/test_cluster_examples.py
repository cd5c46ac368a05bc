"""The cluster examples (examples/cluster, docs/cluster.md): the torchrun command that the SLURM
script and the Kubeflow PyTorchJob start on each node, read from the files with the variables
set as on a 2-node job whose first node is this machine, parsed by torchrun's and interlace's
own parsers, checked against the job's shape, and run as two local torchrun launchers (one CPU
rank each, c10d rendezvous on 127.0.0.1) to a finished 2-rank run."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from string import Template

import pytest
from torch.distributed.run import get_args_parser

from interlace.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "cluster"
NODES = 2
HEAD = "127.0.0.1"
SBATCH = EXAMPLES / "train.sbatch"
PYTORCHJOB = EXAMPLES / "pytorchjob.yaml"


def sbatch_directives() -> dict[str, str]:
    """The script's `#SBATCH --name=value` lines."""
    found = re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.MULTILINE)
    return dict(found)


def sbatch_commands() -> list[list[str]]:
    """What the script's srun starts on each node, as SLURM sets its variables."""
    lines = SBATCH.read_text().replace("\\\n", " ").splitlines()
    (srun,) = [line.strip() for line in lines if line.startswith("srun ")]
    variables = {"SLURM_NNODES": str(NODES), "SLURM_JOB_ID": "4242", "head": HEAD}
    argv = [Template(arg).substitute(variables) for arg in shlex.split(srun)[1:]]
    return [argv] * int(sbatch_directives()["nodes"])


def pytorchjob() -> dict:
    return pytest.importorskip("yaml").safe_load(PYTORCHJOB.read_text())


def trainer_container(replica: dict) -> dict:
    """The container the operator sets up: the one named `pytorch`."""
    (container,) = [c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch"]
    return container


def pytorchjob_commands() -> list[list[str]]:
    """What each replica's container runs, with $(NAME) expanded from the environment the
    operator gives it (MASTER_ADDR, MASTER_PORT: the Master's port named pytorchjob-port)."""
    replicas = pytorchjob()["spec"]["pytorchReplicaSpecs"]
    (port,) = [
        p["containerPort"]
        for p in trainer_container(replicas["Master"])["ports"]
        if p["name"] == "pytorchjob-port"
    ]
    variables = {"MASTER_ADDR": HEAD, "MASTER_PORT": str(port)}
    commands = []
    for name in ("Master", "Worker"):
        container = trainer_container(replicas[name])
        argv = [*container["command"], *container.get("args", [])]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: variables[m[1]], arg) for arg in argv]
        commands += [argv] * replicas[name]["replicas"]
    return commands


EXAMPLE_COMMANDS = [sbatch_commands, pytorchjob_commands]


def launcher_args(argv: list[str]):
    assert argv[0] == "torchrun"
    return get_args_parser().parse_args(argv[1:])


@pytest.mark.parametrize("commands", EXAMPLE_COMMANDS)
def test_every_node_starts_interlace_train_under_torchrun_with_c10d_rendezvous(commands):
    nodes = commands()
    assert len(nodes) == NODES and all(argv == nodes[0] for argv in nodes)
    args = launcher_args(nodes[0])
    assert (args.nnodes, args.nproc_per_node) == (str(NODES), "8")
    assert (args.rdzv_backend, args.rdzv_endpoint.split(":")[0]) == ("c10d", HEAD)
    assert args.rdzv_id and args.module and args.training_script == "interlace.train"
    train = build_parser().parse_args(["train", *args.training_script_args])
    assert train.out.startswith("/shared/") and train.resume == "auto"


def test_the_sbatch_script_starts_one_launcher_per_node_and_meets_on_the_first(tmp_path):
    directives = sbatch_directives()
    assert (directives["nodes"], directives["ntasks-per-node"]) == (str(NODES), "1")
    assert directives["gpus-per-node"] == launcher_args(sbatch_commands()[0]).nproc_per_node
    assert subprocess.run(["bash", "-n", SBATCH], check=False).returncode == 0
    (line,) = [line for line in SBATCH.read_text().splitlines() if line.startswith("head=")]
    scontrol = tmp_path / "scontrol"  # prints the job's hosts, one a line, as SLURM's does
    scontrol.write_text(
        '#!/bin/sh\n[ "$*" = "show hostnames node[7-8]" ] && printf "node7\\nnode8\\n"\n'
    )
    scontrol.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[7-8]",
    }
    head = subprocess.run(["bash", "-c", f'{line}; echo "$head"'], env=env, capture_output=True)
    assert head.stdout.decode() == "node7\n"


def test_the_pytorchjob_replicas_share_one_pod_and_fill_the_nodes():
    replicas = pytorchjob()["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert sum(r["replicas"] for r in replicas.values()) == NODES
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]
    gpus = trainer_container(replicas["Master"])["resources"]["limits"]["nvidia.com/gpu"]
    assert str(gpus) == launcher_args(pytorchjob_commands()[0]).nproc_per_node


def test_the_cluster_docs_quote_the_examples_as_they_are():
    doc = (ROOT / "docs" / "cluster.md").read_text()
    for example in (SBATCH, PYTORCHJOB):
        assert f"\n{example.read_text()}```\n" in doc, f"docs/cluster.md differs from {example}"


def on_this_machine(argv: list[str], port: int, out: Path) -> list[str]:
    """A node's command as it runs here: this Python's torchrun, one rank, the rendezvous on
    `port`, and a short run of the tiny model into `out` in place of the example's options."""
    script = argv.index("interlace.train")
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    for arg in argv[1:script]:
        if arg.startswith("--nproc-per-node="):
            arg = "--nproc-per-node=1"
        elif arg.startswith("--rdzv-endpoint="):
            arg = f"{arg.rsplit(':', 1)[0]}:{port}"
        launcher.append(arg)
    run = ["--model", "tiny", "--steps", "2", "--global-batch", "4", "--eval-every", "0"]
    return [*launcher, "interlace.train", *run, "--no-progress", "--out", str(out)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HEAD, 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("commands", EXAMPLE_COMMANDS)
def test_the_nodes_commands_run_here_as_two_launchers_of_one_run(tmp_path, commands):
    out, port = tmp_path / "run", free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    procs = []
    for node, argv in enumerate(commands()):
        with (tmp_path / f"node{node}.log").open("wb") as log:
            argv = on_this_machine(argv, port, out)
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    logs = "".join(log.read_text() for log in sorted(tmp_path.glob("node*.log")))
    assert codes == [0] * NODES, logs
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["comm_bytes"]["dp"] > 0 for row in rows)  # the ranks all-reduced
    assert json.loads((out / "report.json").read_text())["world_size"] == NODES
