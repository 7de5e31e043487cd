"""AUXILIARY group of the secondary screen: gradient signal-to-noise ratio, CABS and early stopping."""

from cockpit_fast.instruments.drawing import trend_panel


def mean_gsnr_panel(ctx, slot):
    """Mean gradient signal-to-noise ratio against iteration."""
    return trend_panel(ctx, slot, "Mean GSNR", "MeanGSNR", "Mean GSNR")


def cabs_panel(ctx, slot):
    """Batch size suggested by the CABS rule against iteration."""
    return trend_panel(ctx, slot, "CABS", "CABS", "Suggested batch size")


def early_stopping_panel(ctx, slot):
    """Evidence-based early-stopping criterion (stop once positive) against iteration."""
    return trend_panel(ctx, slot, "Early stopping", "EarlyStopping", "Stopping criterion")
