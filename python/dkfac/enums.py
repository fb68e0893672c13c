"""Enumerations with kfac_pytorch's names and values (``kfac.enums``), so scripts that use them run unchanged."""

from __future__ import annotations

from enum import Enum


class AllreduceMethod(Enum):
    """How factors are allreduced: one collective each, or packed into buckets."""

    ALLREDUCE = 1
    ALLREDUCE_BUCKETED = 2


class AssignmentStrategy(Enum):
    """What second-order work placement balances: COMPUTE (dim^3) or MEMORY (dim^2)."""

    COMPUTE = 1
    MEMORY = 2


class ComputeMethod(Enum):
    """Second-order method: eigendecompositions (EIGEN) or damped inverses (INVERSE) of the factors."""

    EIGEN = 1
    INVERSE = 2


class DistributedStrategy(Enum):
    """Shortcuts for grad_worker_fraction: COMM_OPT = 1, HYBRID_OPT = 0.5, MEM_OPT = 1 / world size."""

    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3
