"""TIC with traces of curvature and gradient second moment."""

from cockpit_fast.quantities._tic import TIC


class TICTrace(TIC):
    """Tracks tr(M) / (tr(C) + ε): traces of the gradient second moment and the curvature."""

    def _compute(self, ctx):
        second_moment, curvature = self._second_moment_and_curvature(ctx)
        return second_moment.sum() / (curvature.sum() + self._epsilon)
