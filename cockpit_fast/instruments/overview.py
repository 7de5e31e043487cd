"""Bottom row: hyperparameters and the training performance (loss and accuracies)."""

import numpy as np

from cockpit_fast.instruments.drawing import (
    format_iteration_axis,
    legend_with_latest,
    missing_panel,
    plot_trend,
    titled_axes,
)


def hyperparameter_panel(ctx, slot):
    """Learning rate (as given to ``Cockpit.log``) against iteration."""
    title = "Hyperparameters"
    steps, rates = ctx.log.series("learning_rate")
    if not len(rates):
        return missing_panel(ctx, slot, title, ["learning_rate"])

    ax = titled_axes(ctx, slot, title, face=ctx.theme.summary_face)
    ax.plot(steps, rates, color=ctx.theme.secondary, linewidth=2, label="Learning Rate")
    ax.set_ylabel("Learning rate")
    format_iteration_axis(ctx, ax, steps)
    legend_with_latest(ax, loc="upper right")
    return ax


def performance_panel(ctx, slot):
    """Mini-batch loss against iteration, with train and validation accuracy on a second axis."""
    title = "Performance Plot"
    loss = ctx.log.series("Loss")
    theme = ctx.theme
    accuracies = [  # (label, colour, (steps, values)) of the accuracies that were logged
        (label, color, ctx.log.series(name))
        for name, label, color in (
            ("train_accuracy", "Train Accuracy", theme.primary),
            ("valid_accuracy", "Valid Accuracy", theme.secondary),
        )
    ]
    accuracies = [accuracy for accuracy in accuracies if len(accuracy[2][1])]
    if not len(loss[1]) and not accuracies:
        return missing_panel(ctx, slot, title, ["Loss", "train_accuracy", "valid_accuracy"])

    ax = titled_axes(ctx, slot, title, face=theme.summary_face)
    if len(loss[1]):
        plot_trend(ctx, ax, *loss)
        ax.set_ylabel("Loss")
    if accuracies:
        accuracy_ax = ax.twinx() if len(loss[1]) else ax
        for label, color, (steps, values) in accuracies:
            accuracy_ax.plot(steps, values, color=color, linewidth=2, label=label)
        accuracy_ax.set_ylim(0, 1)
        accuracy_ax.set_ylabel("Accuracy")
        legend_with_latest(accuracy_ax, percentage=True, loc="upper right")
    all_steps = np.concatenate([loss[0]] + [steps for _, _, (steps, _) in accuracies])
    format_iteration_axis(ctx, ax, all_steps)
    return ax
