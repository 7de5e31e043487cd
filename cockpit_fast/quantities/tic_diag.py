"""TIC with a diagonal curvature approximation."""

from cockpit_fast.quantities._tic import TIC


class TICDiag(TIC):
    """Tracks sum_j M_j / (C_j + ε): gradient second moment M over diagonal curvature C."""

    def _compute(self, ctx):
        second_moment, curvature = self._second_moment_and_curvature(ctx)
        return (second_moment / (curvature + self._epsilon)).sum()
