"""When to save: pure functions of the position in training and the periods."""


def epoch_checkpoint_due(epoch: int, max_epoch: int, epoch_period: int) -> bool:
    """Whether the end of 0-based `epoch` is saved: every `epoch_period` epochs and
    after the last epoch."""
    return epoch + 1 == max_epoch or (epoch + 1) % epoch_period == 0


def iteration_checkpoint(
    epoch: int,
    done: int,
    iters: int,
    max_epoch: int,
    epoch_period: int,
    iter_period: int,
) -> tuple[int, int] | None:
    """The (epoch, iteration) to save after `done` of `iters` iterations of 0-based
    `epoch` under an iteration period (0: none), or None.

    An iteration period that lands on the epoch's last iteration saves it as the
    start of the next epoch, (epoch + 1, 0), when no epoch checkpoint follows:
    without it a crash early in the next epoch would lose two periods."""
    if not iter_period or done % iter_period:
        return None
    if done < iters:
        return epoch, done
    if epoch_checkpoint_due(epoch, max_epoch, epoch_period):
        return None  # the epoch checkpoint saves this very position
    return epoch + 1, 0


def stop_checkpoint(epoch: int, done: int, iters: int) -> tuple[int, int]:
    """The (epoch, iteration) to save when stopping after `done` of `iters`
    iterations of 0-based `epoch`."""
    return (epoch, done) if done < iters else (epoch + 1, 0)
