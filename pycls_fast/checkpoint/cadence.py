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

    An iteration period that lands on the epoch's last iteration saves (epoch,
    iters) when no epoch checkpoint follows (without it a crash early in the next
    epoch would lose two periods): the epoch's iterations done, its end (the
    train_epoch record, precise BN, the evaluation) still to do on a resume."""
    if not iter_period or done % iter_period:
        return None
    if done == iters and epoch_checkpoint_due(epoch, max_epoch, epoch_period):
        return None  # the epoch's own checkpoint follows, after its end
    return epoch, done


def stop_checkpoint(epoch: int, done: int, iters: int) -> tuple[int, int]:
    """The (epoch, iteration) to save when stopping after `done` of `iters`
    iterations of 0-based `epoch`: after the last one too, (epoch, iters), so
    that a resume does the epoch's end (its record, precise BN, its evaluation),
    which the stop cut off."""
    return epoch, done
