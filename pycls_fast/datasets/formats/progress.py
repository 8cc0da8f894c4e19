"""Progress of the dataset tools (prepare_imagenet, pack_dataset): a bar with the time
left on a terminal, else a line every 5% in a log."""

import sys
import time
from collections.abc import Callable


def progress_printer(what: str, unit: str = "item") -> Callable[[int, int], None]:
    """A callback `(done, total)`. The time left is measured from the first call, so
    that work a resumed run skips does not count as speed."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc=what, unit=unit)

        def update(done, total):
            bar.total = total
            bar.update(done - bar.n)
            if done == total:
                bar.close()

        return update
    start = time.monotonic()
    first, last = [], [-1]

    def line(done, total):
        if not first:
            first.append(done)
        step = max(total // 20, 1)
        if done // step == last[0] // step and done != total:
            return
        last[0] = done
        rate = (done - first[0]) / max(time.monotonic() - start, 1e-9)
        left = f"~{(total - done) / rate:.0f} s left" if rate > 0 else "timing..."
        print(f"{what}: {done}/{total} {unit}s, {left}", file=sys.stderr, flush=True)

    return line
