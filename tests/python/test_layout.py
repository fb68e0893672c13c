"""KAISA's grid as Python reports it (``distributed_strategy``, ``grad_worker_fraction``, ``colocate_factors``) is
the grid the core runs, for every world size up to 8 and the fractions around the rounding halves. The rules
(W = round(P f) with halves away from zero, f = 0 as 1/P, MEM_OPT forcing colocate_factors) live in the core
(dkfac/assign/assignment.h, ``kaisa_layout``); Python converts names. Multi-rank jobs report it too:
test_distributed.py checks their reports against the plan they ran."""

from __future__ import annotations

import pytest
import torch

import dkfac
from dkfac import _C
from dkfac.enums import DistributedStrategy

ONE_LAYER = [(8, 4)]  # one layer: where factors are not colocated and W >= 2, its A and G land on two ranks


def kfac_pytorch_name(workers: int, size: int) -> DistributedStrategy:
    """kfac_pytorch's name of a grid of `workers` gradient workers per layer on `size` ranks."""
    if workers == size:
        return DistributedStrategy.COMM_OPT
    return DistributedStrategy.MEM_OPT if workers == 1 else DistributedStrategy.HYBRID_OPT


def fractions(size: int) -> list[float]:
    # 0 and 1/P (MEM_OPT), 0.5, 0.9, 1, and fractions where P f is k + 1/2 for some P: 0.1 (P=5), 0.25 (P=2, 6),
    # 0.3 (P=5), 0.5 (odd P), 0.5625 (P=8), 0.625 (P=4, 8), 0.75 (P=2, 6), 0.9 (P=5).
    return sorted({0.0, 1 / size, 0.1, 0.25, 0.3, 0.5, 0.5625, 0.625, 0.75, 0.9, 1.0})


def reported(size: int, fraction: float, colocate: bool) -> dict:
    """What a KFACPreconditioner on `size` ranks reports: its core's layout (the same function, kaisa_layout)."""
    return dkfac.preconditioner._layout_fields(_C.kaisa_layout(size, fraction, colocate))


@pytest.mark.parametrize('size', range(1, 9))
def test_reported_layout_is_the_grid_the_core_runs(size):
    for fraction in fractions(size):
        for colocate in (True, False):
            options = dict(strategy='kaisa', grad_worker_fraction=fraction, colocate_factors=colocate,
                           compute_method='inverse')
            case = f'P={size} f={fraction} colocate_factors={colocate}'
            try:
                ran = _C.step_plan_placement(size, options, ONE_LAYER)  # the plan a job of `size` ranks runs
            except ValueError as refused:
                assert size > 1 and 'does not divide the world size' in str(refused), case
                with pytest.raises(ValueError, match='does not divide the world size'):
                    reported(size, fraction, colocate)
                continue
            got = reported(size, fraction, colocate)
            (a_worker, g_worker, grad_workers), = ran['layers']
            assert len(grad_workers) == ran['grad_workers'], case
            assert got['distributed_strategy'] is kfac_pytorch_name(ran['grad_workers'], size), (case, ran)
            assert got['grad_worker_fraction'] == (fraction or 1 / size), case
            if size > 1:
                assert got['colocate_factors'] == (a_worker == g_worker), (case, ran)
            else:
                assert got['colocate_factors'] == colocate, case  # one rank: nothing to place, kept as given


@pytest.mark.parametrize('size,fraction,strategy,workers', [
    (5, 0.9, DistributedStrategy.COMM_OPT, 5),    # P f = 4.5: W = 5 (Python's round() says 4, HYBRID_OPT)
    (2, 0.25, DistributedStrategy.MEM_OPT, 1),    # 0.5 -> 1
    (6, 0.25, DistributedStrategy.HYBRID_OPT, 2),  # 1.5 -> 2
    (6, 0.75, None, None),                        # 4.5 -> 5, which does not divide 6
    (8, 0.5625, None, None),                      # 4.5 -> 5 (round(): 4, which would divide 8)
    (4, 0.625, None, None),                       # 2.5 -> 3 (round(): 2)
    (4, 0.0, DistributedStrategy.MEM_OPT, 1),     # 0: 1/P
])
def test_halves_round_away_from_zero(size, fraction, strategy, workers):
    if strategy is None:
        with pytest.raises(ValueError, match=f'grad_worker_fraction {fraction} gives W=.* does not divide'):
            _C.step_plan_placement(size, dict(grad_worker_fraction=fraction), ONE_LAYER)
        return
    assert _C.step_plan_placement(size, dict(grad_worker_fraction=fraction), ONE_LAYER)['grad_workers'] == workers
    assert reported(size, fraction, True)['distributed_strategy'] is strategy


def test_mem_opt_turns_colocation_on_and_the_plan_warns():
    options = dict(grad_worker_fraction=0, colocate_factors=False, compute_method='inverse')
    with pytest.warns(UserWarning, match=r'grad_worker_fraction=1/world_size \(MEM_OPT\) requires '
                                         r'colocate_factors=True; enabling it'):
        with dkfac.base_preconditioner._CoreWarnings():
            ran = _C.step_plan_placement(4, options, ONE_LAYER)
    assert ran['colocate_factors'] and ran['grad_worker_fraction'] == 0.25
    assert reported(4, 0, False)['colocate_factors'] is True
    assert reported(4, 0.5, False)['colocate_factors'] is False


@pytest.mark.parametrize('fraction', [0, 0.5, 1.0, DistributedStrategy.COMM_OPT, DistributedStrategy.MEM_OPT,
                                      DistributedStrategy.HYBRID_OPT])
@pytest.mark.parametrize('colocate', [True, False])
def test_a_preconditioner_reports_its_cores_layout(fraction, colocate):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    preconditioner = dkfac.KFACPreconditioner(model, grad_worker_fraction=fraction, colocate_factors=colocate,
                                              compute_method='inverse')
    got = {name: getattr(preconditioner, name) for name in ('distributed_strategy', 'grad_worker_fraction',
                                                             'colocate_factors')}
    assert got == dkfac.preconditioner._layout_fields(preconditioner._core.layout)
    # One process: every rank (the one) preconditions every layer; kfac_pytorch's shortcuts name fractions.
    value = {DistributedStrategy.COMM_OPT: 1.0, DistributedStrategy.MEM_OPT: 0.0,
             DistributedStrategy.HYBRID_OPT: 0.5}.get(fraction, fraction)
    assert got == {'distributed_strategy': DistributedStrategy.COMM_OPT,
                   'grad_worker_fraction': float(value or 1.0), 'colocate_factors': colocate}
    fields = repr(preconditioner)
    assert 'distributed_strategy=DistributedStrategy.COMM_OPT,' in fields
    assert f'grad_worker_fraction={float(value or 1.0)},' in fields and f'colocate_factors={colocate},' in fields
