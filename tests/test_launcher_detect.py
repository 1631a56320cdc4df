"""Rank, world size and local rank from each launcher's variables, and which launcher wins when a
process sees the variables of several (tests/test_runtime_launcher.py runs real MPI jobs)."""

from __future__ import annotations

import pytest

from runtime import RunError
from runtime.launcher import LaunchEnv, check_mpi_agrees, detect_launcher

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_RANK": "5"}  # Open MPI 4/5 set PMIX_RANK too
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "9"}
TORCHRUN = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "GROUP_RANK": "1"}
SRUN = {"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42"}
# An sbatch script's own shell: Slurm variables of the batch step, but no srun step.
SBATCH_SHELL = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "42"}


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    (OPEN_MPI, LaunchEnv("Open MPI", 5, 8, 1, 4)),
    (HYDRA, LaunchEnv("MPICH/Hydra", 3, 4, 1, 2)),
    ({"PMIX_RANK": "3", "PMIX_NAMESPACE": "job"}, LaunchEnv("PMIx", 3, None)),
    (TORCHRUN, LaunchEnv("torchrun", 6, 8, 2, 4, mpi=False)),
    (SRUN, LaunchEnv("Slurm", 7, 8, 3, None)),
    # srun --mpi=pmix: PMIx and Slurm agree; the MPI-level variable wins.
    ({**SRUN, "PMIX_RANK": "7"}, LaunchEnv("PMIx", 7, None)),
    # mpirun/mpiexec inside an sbatch allocation: the ranks inherit the batch shell's SLURM_PROCID=0.
    ({**SBATCH_SHELL, **OPEN_MPI}, LaunchEnv("Open MPI", 5, 8, 1, 4)),
    ({**SBATCH_SHELL, **HYDRA}, LaunchEnv("MPICH/Hydra", 3, 4, 1, 2)),
    # Hydra's ranks under srun (its Slurm bootstrap): the proxies' step variables are inherited.
    ({**SRUN, **HYDRA}, LaunchEnv("MPICH/Hydra", 3, 4, 1, 2)),
    # srun torchrun ...: SLURM_PROCID is the node (torchrun's agent); torchrun's RANK is the rank.
    ({**SRUN, "SLURM_PROCID": "1", **TORCHRUN}, LaunchEnv("torchrun", 6, 8, 2, 4, mpi=False)),
    # A user's RANK/WORLD_SIZE without MASTER_ADDR/MASTER_PORT is not a torch-style launch.
    ({"RANK": "1", "WORLD_SIZE": "2"}, None),
    # transpile run in an sbatch script without srun starts the ranks itself.
    (SBATCH_SHELL, None),
    # Open MPI variables win over a torch-style environment left in the shell.
    ({**TORCHRUN, **OPEN_MPI}, LaunchEnv("Open MPI", 5, 8, 1, 4)),
], ids=["none", "openmpi", "hydra", "pmix", "torchrun", "srun", "srun-pmix", "mpirun-in-sbatch",
        "mpiexec-in-sbatch", "hydra-under-srun", "srun-torchrun", "rank-without-master", "sbatch-shell",
        "openmpi-over-torch-env"])
def test_detect_launcher(environ, expected):
    assert detect_launcher(environ) == expected


@pytest.mark.parametrize("environ, message", [
    ({"PMI_RANK": "one", "PMI_SIZE": "2"}, "MPICH/Hydra launcher: PMI_RANK='one' in the environment is not an integer"),
    ({**TORCHRUN, "LOCAL_RANK": "-1"}, "torchrun launcher: LOCAL_RANK=-1 in the environment is negative"),
    ({**TORCHRUN, "RANK": "8"}, "torchrun launcher: RANK=8 is not below WORLD_SIZE=8"),
])
def test_bad_launcher_variables_are_one_line_errors(environ, message):
    with pytest.raises(RunError, match=f"^{message}$"):
        detect_launcher(environ)


def test_mpi_must_see_the_launchers_world():
    srun = detect_launcher(SRUN)
    check_mpi_agrees(srun, 7, 8)
    # srun without --mpi=pmix/pmi2: every task is an MPI world of one, and would train alone.
    with pytest.raises(RunError, match=r"made this rank 7 of 8, but MPI sees rank 0 of 1: MPI is not using Slurm's "
                                       r"process manager \(under srun pass --mpi=pmix"):
        check_mpi_agrees(srun, 0, 1)
    check_mpi_agrees(detect_launcher({"PMIX_RANK": "3"}), 3, 4)  # PMIx publishes no size: MPI's stands


@pytest.mark.parametrize("gpus, local_rank, local_size, device", [
    (4, 2, 4, 2),  # local rank r drives device r
    (1, 3, 4, 0),  # one GPU visible per rank (srun --gpus-per-task=1): it is device 0
    (8, 1, None, 1),  # torchrun without LOCAL_WORLD_SIZE
])
def test_the_local_rank_picks_the_gpu(monkeypatch, gpus, local_rank, local_size, device):
    from runtime.devices import pick_gpu

    monkeypatch.setattr("runtime.gpu.cuda.gpu_count", lambda: gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(local_rank) if gpus == 1 else "")
    assert pick_gpu(local_rank, local_size) == device


def test_ranks_sharing_the_machine_s_only_gpu_is_one_line(monkeypatch):
    """One GPU and no per-rank CUDA_VISIBLE_DEVICES: four local ranks would share it (NCCL refuses
    that later, with no hint of why): the same line as for too few GPUs."""
    from runtime.devices import pick_gpu

    monkeypatch.setattr("runtime.gpu.cuda.gpu_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RunError, match=r"^4 rank\(s\) on this host needs 4 GPU\(s\), one per rank, but this machine has 1"):
        pick_gpu(3, 4)
    assert pick_gpu(0, 1) == 0  # one rank, one GPU


def test_more_local_ranks_than_gpus_is_one_line(monkeypatch):
    from runtime.devices import pick_gpu

    monkeypatch.setattr("runtime.gpu.cuda.gpu_count", lambda: 2)
    with pytest.raises(RunError, match=r"^4 rank\(s\) on this host needs 4 GPU\(s\), one per rank, but this machine has 2"):
        pick_gpu(1, 4)
