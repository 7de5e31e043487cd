"""What quantities need to know about the optimizer."""

import math

import torch


def is_plain_sgd(optimizer):
    """Whether ``optimizer`` is SGD without momentum, dampening, Nesterov, weight decay or
    ``maximize``.

    Only then is the update ``-lr * gradient``, known inside the backward pass.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return all(
        math.isclose(group["weight_decay"], 0.0, abs_tol=1e-8)
        and math.isclose(group["momentum"], 0.0, abs_tol=1e-8)
        and math.isclose(group["dampening"], 0.0, abs_tol=1e-8)
        and group["nesterov"] is False
        and not group.get("maximize", False)
        for group in optimizer.param_groups
    )


def require_plain_sgd(optimizer, quantity):
    """Raise a ValueError unless ``optimizer`` is plain SGD (see :func:`is_plain_sgd`)."""
    if not is_plain_sgd(optimizer):
        raise ValueError(
            f"{type(quantity).__name__} only supports SGD without momentum (nor dampening, Nesterov, weight decay or "
            f"maximize), got {optimizer}"
        )


def single_learning_rate(optimizer):
    """The learning rate shared by all parameter groups; a ValueError if they differ."""
    rates = {group["lr"] for group in optimizer.param_groups}
    if len(rates) != 1:
        raise ValueError(f"Found non-unique learning rates {rates}")
    return rates.pop()


def learning_rates(optimizer):
    """Learning rate of each parameter the optimizer updates, keyed by ``id(param)``."""
    return {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
